"""Prompt text for the load generator: random text of a length, rendering, token counting.

With a Hugging Face tokenizer, lengths are in tokens and prompt lengths are counted. Without
one (the tokenizer-free fallback), lengths are in words from a fixed list and prompt token
counts come from the server's usage report instead.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Literal, Protocol, cast

Endpoint = Literal["chat", "completions"]


@dataclass(frozen=True)
class Message:
    """One chat message of a benchmark prompt."""

    role: str
    content: str


_WORD_LIST = """time year people way day man thing woman life child world school state family
    student group country problem hand part place case week company system program question work
    government number night point home water room mother area money story fact month lot right
    study book eye job word business issue side kind head house service friend father power hour
    game line end member law car city community name president team minute idea kid body
    information back parent face others level office door health person art war history party
    result change morning reason research girl guy moment air teacher force education river
    stone light music garden window market table letter paper voice answer field"""
WORDS = tuple(_WORD_LIST.split())


class Tokenizer(Protocol):
    """The part of a Hugging Face tokenizer the load generator uses."""

    vocab_size: int
    all_special_ids: list[int]
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(
        self, conversation: list[dict[str, str]], tokenize: bool, add_generation_prompt: bool
    ) -> Any: ...


def load_tokenizer(name: str) -> Tokenizer:
    """A model alias (``smollm2-135m-instruct``), a GGUF file or a Hugging Face directory."""
    from splitserve.engine.loader import load_tokenizer as load
    from splitserve.engine.loader import resolve_model

    return cast(Tokenizer, load(resolve_model(name)))


@dataclass(frozen=True)
class TextSource:
    """Makes prompt text and counts it; ``tokenizer=None`` is the word-based fallback."""

    tokenizer: Tokenizer | None = None

    def text(self, rng: random.Random, length: int) -> str:
        """Random text of ``length`` tokens (or words, without a tokenizer)."""
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS) for _ in range(length))
        return _token_text(self.tokenizer, rng, length)

    def render(self, messages: tuple[Message, ...]) -> str:
        """The single prompt string sent to the completions endpoint."""
        if len(messages) == 1 and messages[0].role == "user":
            return messages[0].content
        if self.tokenizer is not None and self.tokenizer.chat_template:
            return self._chat_text(messages)
        lines = [f"{m.role}: {m.content}" for m in messages]
        return "\n\n".join([*lines, "assistant:"])

    def prompt_len(self, messages: tuple[Message, ...], endpoint: Endpoint) -> int | None:
        """Prompt tokens as the server will see them, or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        if endpoint == "chat" and self.tokenizer.chat_template:
            return len(self.tokenizer.encode(self._chat_text(messages), add_special_tokens=False))
        return len(self.tokenizer.encode(self.render(messages)))

    def _chat_text(self, messages: tuple[Message, ...]) -> str:
        assert self.tokenizer is not None
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = self.tokenizer.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        return str(text)


def _token_text(tokenizer: Tokenizer, rng: random.Random, length: int) -> str:
    """Text that re-tokenizes to ``length`` tokens where the tokenizer allows it.

    Decoding random ids and encoding again can merge or split tokens, so the ids are
    trimmed or topped up a few times until the round trip has the asked length.
    """
    special = set(tokenizer.all_special_ids)
    ids = _random_ids(tokenizer.vocab_size, special, rng, length)
    text = tokenizer.decode(ids)
    for _ in range(4):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            break
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids = ids + _random_ids(tokenizer.vocab_size, special, rng, length - len(ids))
        text = tokenizer.decode(ids)
    return text


def _random_ids(vocab_size: int, special: set[int], rng: random.Random, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        token = rng.randrange(vocab_size)
        if token not in special:
            ids.append(token)
    return ids
