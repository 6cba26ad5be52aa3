"""Seeded sampling, stop strings, stop token ids, min_tokens and logprobs on SmolLM2."""

from __future__ import annotations

import math

import pytest

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "My favourite animals are"


def test_seeded_sampling_is_reproducible_across_batch_compositions(smollm2_llm: LLM) -> None:
    seeded = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=1234)
    alone = smollm2_llm.generate([PROMPT], seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = ["Numbers:", "A long story about a dragon who lived " * 4, "Hello"]
    mixed = (
        smollm2_llm.generate([*others[:2], PROMPT, others[2]], seeded, use_tqdm=False)[2]
        .outputs[0]
        .token_ids
    )
    assert mixed == alone
    unseeded = SamplingParams(max_tokens=24, temperature=0.9)
    noise = smollm2_llm.generate([PROMPT, PROMPT], unseeded, use_tqdm=False)
    assert noise[0].outputs[0].token_ids != noise[1].outputs[0].token_ids
    other_seed = SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, top_k=50, seed=99)
    assert (
        smollm2_llm.generate([PROMPT], other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone
    )


def test_stop_string_cuts_exactly_before_the_stop_and_finishes_with_stop(smollm2_llm: LLM) -> None:
    free = smollm2_llm.generate(
        ["Count: 1, 2, 3,"], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False
    )[0].outputs[0]
    assert " 6," in free.text
    cut = smollm2_llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(max_tokens=30, temperature=0, stop=[" 6,", "zzz"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert cut.text == free.text[: free.text.index(" 6,")]
    assert cut.finish_reason == "stop"
    assert cut.stop_reason == " 6,"
    kept = smollm2_llm.generate(
        ["Count: 1, 2, 3,"],
        SamplingParams(max_tokens=30, temperature=0, stop=[" 6,"], include_stop_str_in_output=True),
        use_tqdm=False,
    )[0].outputs[0]
    assert kept.text == free.text[: free.text.index(" 6,") + 3]


def test_stop_token_id_and_max_tokens_and_min_tokens(smollm2_llm: LLM) -> None:
    free = smollm2_llm.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 12
    stop_id = free.token_ids[3]
    first = free.token_ids.index(stop_id)
    stopped = smollm2_llm.generate(
        [PROMPT],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_id
    chat = smollm2_llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(max_tokens=64, temperature=0),
        use_tqdm=False,
    )[0]
    natural = len(chat.outputs[0].token_ids)
    assert chat.outputs[0].finish_reason == "stop" and natural < 64
    longer = smollm2_llm.chat(
        [{"role": "user", "content": "Say hi."}],
        SamplingParams(max_tokens=64, temperature=0, min_tokens=natural + 5),
        use_tqdm=False,
    )[0]
    assert len(longer.outputs[0].token_ids) >= natural + 5


def test_logprobs_report_sampled_token_and_top_n(smollm2_llm: LLM) -> None:
    out = smollm2_llm.generate(
        [PROMPT], SamplingParams(max_tokens=5, temperature=0, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    total = 0.0
    for token, entries in zip(out.token_ids, out.logprobs):
        assert entries[token].rank == 1
        assert len(entries) == 3
        assert all(e.logprob <= entries[token].logprob for e in entries.values())
        assert sum(math.exp(e.logprob) for e in entries.values()) <= 1.0 + 1e-5
        total += entries[token].logprob
    assert out.cumulative_logprob == pytest.approx(total)
