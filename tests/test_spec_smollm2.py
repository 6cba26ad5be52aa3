"""Speculative decoding on the real SmolLM2 with n-gram drafts, where answers copy a passage:
greedy outputs, stop strings, max_tokens, logprobs and structured outputs are what they are
without speculation, while several tokens arrive in one step."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve import LLM, SamplingParams, StructuredOutputsParams
from splitserve.engine.request import RequestOutput
from splitserve.engine.spec.config import SpeculativeConfig

pytestmark = pytest.mark.slow

PASSAGE = (
    "The Amazon rainforest covers much of the Amazon basin of South America. This basin "
    "encompasses seven million square kilometres, of which five and a half million square "
    "kilometres are covered by the rainforest. The region includes territory belonging to "
    "nine nations and 3,344 formally acknowledged indigenous territories."
)
ASKS = [
    f"Repeat the following passage exactly:\n\n{PASSAGE}",
    f"Copy the second sentence of this passage:\n\n{PASSAGE}",
    f"Rewrite this passage as a bulleted list, keeping its words:\n\n{PASSAGE}",
    "Write a short poem about the sea.",
]


@pytest.fixture(scope="module")
def speculative(make_llm: Callable[..., LLM]) -> LLM:
    return make_llm(speculative=SpeculativeConfig("ngram", 6, dynamic=False))


def _prompts(llm: LLM) -> list[list[int]]:
    return [llm.apply_chat_template([{"role": "user", "content": ask}]) for ask in ASKS]


def _same(a: RequestOutput, b: RequestOutput) -> None:
    x, y = a.outputs[0], b.outputs[0]
    assert (x.token_ids, x.text, x.finish_reason, x.stop_reason) == (
        y.token_ids,
        y.text,
        y.finish_reason,
        y.stop_reason,
    )
    if x.logprobs is not None:
        assert y.logprobs is not None and len(x.logprobs) == len(y.logprobs)
        for here, there in zip(x.logprobs, y.logprobs):
            assert list(here) == list(there)
            for token, entry in here.items():
                assert entry.logprob == pytest.approx(there[token].logprob, abs=1e-3)
                assert entry.decoded_token == there[token].decoded_token


def test_greedy_outputs_equal_and_drafts_mostly_accepted(
    smollm2_llm: LLM, speculative: LLM
) -> None:
    params = SamplingParams(max_tokens=48, temperature=0)
    plain = smollm2_llm.generate(_prompts(smollm2_llm), params, use_tqdm=False)
    spec = speculative.generate(_prompts(speculative), params, use_tqdm=False)
    for a, b in zip(plain, spec):
        _same(a, b)
    stats = speculative.engine.stats()
    assert stats.spec_num_accepted_tokens > 0.4 * stats.spec_num_draft_tokens


def test_stops_max_tokens_and_logprobs_with_several_tokens_a_step(
    smollm2_llm: LLM, speculative: LLM
) -> None:
    params = [
        SamplingParams(max_tokens=60, temperature=0, stop=["square"]),
        SamplingParams(
            max_tokens=60, temperature=0, stop=["nations"], include_stop_str_in_output=True
        ),
        SamplingParams(max_tokens=13, temperature=0, logprobs=3),
        SamplingParams(max_tokens=60, temperature=0, stop_token_ids=[28]),  # "."
        SamplingParams(max_tokens=40, temperature=0, repetition_penalty=1.3, logprobs=0),
    ]  # fmt: skip
    prompts = _prompts(smollm2_llm)
    prompts = [prompts[0], prompts[0], prompts[1], prompts[2], prompts[0]]
    before = speculative.engine.stats().spec_num_accepted_tokens
    plain = smollm2_llm.generate(prompts, params, use_tqdm=False)
    spec = speculative.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        _same(a, b)
    assert [o.outputs[0].finish_reason for o in spec] == [
        "stop",
        "stop",
        "length",
        "stop",
        "stop",
    ]
    assert speculative.engine.stats().spec_num_accepted_tokens > before


NATIONS = {
    "type": "object",
    "properties": {"nations": {"type": "integer"}},
    "required": ["nations"],
}


def test_structured_outputs_equal_with_drafts(smollm2_llm: LLM, speculative: LLM) -> None:
    constraints = [
        StructuredOutputsParams(regex=r"The Amazon [a-z ]+\."),
        StructuredOutputsParams(json=NATIONS),
        StructuredOutputsParams(choice=["seven million", "five and a half million"]),
    ]  # fmt: skip
    params = [
        SamplingParams(max_tokens=60, temperature=0, structured_outputs=c) for c in constraints
    ]
    prompts = _prompts(smollm2_llm)[:3]
    plain = smollm2_llm.generate(prompts, params, use_tqdm=False)
    spec = speculative.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec):
        _same(a, b)
