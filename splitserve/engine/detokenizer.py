"""Incremental detokenization and stop strings.

Text is decoded over a sliding window of tokens so that a character split across tokens is
emitted only once it is complete. While stop strings are active, the last len(stop) - 1
characters are held back, so the visible text only ever grows and never shows part of a stop
string.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.engine.request import Request

_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        kept: frozenset[int] = frozenset(),
    ) -> None:
        """kept: special tokens written although skip_special_tokens drops the others."""
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.kept = kept if skip_special_tokens else frozenset()
        self.tokens = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.text = ""
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.holdback = max((len(s) for s in stop), default=1) - 1

    @classmethod
    def for_request(cls, tokenizer: Any, req: Request) -> IncrementalDetokenizer:
        """The detokenizer of a request's output; a resumed request's (engine/resume.py)
        continues after the earlier run's tokens."""
        params, prompt = req.params, req.prompt_token_ids
        original = len(prompt) - req.num_resumed
        detok = cls(
            tokenizer,
            prompt[:original],
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            frozenset(params.kept_special_token_ids),
        )
        if req.num_resumed:
            detok.replay(prompt[original:], req.resumed_chars)
        return detok

    def add(self, token_id: int, check_stop: bool = True) -> str | None:
        """Append a token; returns the stop string if the text now contains one."""
        self.tokens.append(token_id)
        start = len(self.text)
        self.text += self._decode_new(final=False)
        if not (check_stop and self.stop):
            return None
        return self._cut_at_stop(start)

    def replay(self, tokens: list[int], shown: int) -> None:
        """Continue a resumed request (engine/resume.py): ``tokens`` are an earlier run's output,
        whose first ``shown`` characters its client already has. What that run still held back
        (the possible start of a stop string, a character not complete yet) comes out next."""
        for token_id in tokens:
            self.add(token_id, check_stop=False)
        self.text = self.text[min(shown, len(self.text)) :]

    def flush(self) -> None:
        """Emit whatever is pending (an incomplete character included) at the end."""
        self.text += self._decode_new(final=True)

    def visible_text(self, finished: bool) -> str:
        if finished or not self.holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]

    def _decode_new(self, final: bool) -> str:
        prefix = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset :])
        if len(full) <= len(prefix) or (full.endswith("\ufffd") and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.tokens)
        return full[len(prefix) :]

    def _decode(self, tokens: list[int]) -> str:
        if not self.kept or self.kept.isdisjoint(tokens):
            return str(self.tokenizer.decode(tokens, skip_special_tokens=self.skip_special_tokens))
        text, run = "", list[int]()
        for token in tokens:  # the runs between kept tokens decoded as before, each kept one
            if token in self.kept:
                text += str(self.tokenizer.decode(run, skip_special_tokens=True))
                text += str(self.tokenizer.decode([token], skip_special_tokens=False))
                run = []
            else:
                run.append(token)
        return text + str(self.tokenizer.decode(run, skip_special_tokens=True))

    def _cut_at_stop(self, new_text_start: int) -> str | None:
        search_from = max(0, new_text_start - self.holdback)
        found = [(self.text.find(s, search_from), s) for s in self.stop]
        hits = [(index, s) for index, s in found if index != -1]
        if not hits:
            return None
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        return stop
