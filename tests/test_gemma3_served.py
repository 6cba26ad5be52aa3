"""Gemma 3 270M (its real weights, on CPU) served colocated and 1P1D: greedy completions are
transformers' tokens exactly (tests/support/gemma3.py) for a short prompt and one past two of
its 512-token sliding windows, in one batch; a chat in Gemma's turns through the official
openai client. The 1P1D deployment is
`splitserve serve --set model=gemma3-270m` (the embedded default's pools); the colocated one
is configs/colocated.yaml with that model."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.support.gemma3 import (
    CHAT,
    CHAT_PIECES,
    CHAT_PROMPT_TOKENS,
    MODEL,
    NEW_TOKENS,
    SERVED_PIECES,
    SERVED_PROMPT_TOKENS,
    SERVED_TEXTS,
)
from tests.support.server_process import ServerProcess, serve

pytestmark = pytest.mark.slow
CONFIGS = {"1p1d": None, "colocated": "configs/colocated.yaml"}


@pytest.fixture(scope="module", params=list(CONFIGS))
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """One deployment at a time: the second starts once the first has stopped."""
    with serve(f"model={MODEL}", config=CONFIGS[request.param]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def test_greedy_completions_are_transformers_tokens_past_the_sliding_window(
    client: openai.OpenAI,
) -> None:
    out = client.completions.create(
        model=MODEL,
        prompt=list(SERVED_TEXTS),
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=0,
    )
    choices = sorted(out.choices, key=lambda c: c.index)
    assert [c.logprobs.tokens for c in choices] == [list(p) for p in SERVED_PIECES]  # type: ignore[union-attr]
    assert [c.text for c in choices] == ["".join(p) for p in SERVED_PIECES]
    assert [c.finish_reason for c in choices] == ["length"] * len(SERVED_TEXTS)
    assert out.usage is not None
    assert out.usage.prompt_tokens == sum(SERVED_PROMPT_TOKENS)
    assert out.usage.completion_tokens == NEW_TOKENS * len(SERVED_TEXTS)


def test_a_chat_in_gemma_turns_is_answered_with_transformers_tokens(
    client: openai.OpenAI,
) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        max_tokens=NEW_TOKENS,
        temperature=0,
        logprobs=True,
    )
    choice = out.choices[0]
    assert choice.message.content == "".join(CHAT_PIECES)
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert tuple(t.token for t in choice.logprobs.content) == CHAT_PIECES
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (
        CHAT_PROMPT_TOKENS,
        NEW_TOKENS,
    )
