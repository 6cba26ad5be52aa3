"""Continuous batching, chunked prefill, prefix reuse and preemption keep outputs unchanged."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def _mixed_prompts(count: int) -> list[str]:
    subjects = ["cats", "the ocean", "databases", "mountains", "jazz", "rockets", "bread", "rain"]
    prompts = []
    for i in range(count):
        subject = subjects[i % len(subjects)]
        prompts.append(f"Write about {subject}. " * (1 + 3 * (i % 5)) + f"Paragraph {i}:")
    return prompts


def _token_ids(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def test_prompt_alone_equals_prompt_inside_batch_of_16_mixed_lengths(smollm2_llm: LLM) -> None:
    prompts = _mixed_prompts(16)
    batched = _token_ids(smollm2_llm.generate(prompts, GREEDY, use_tqdm=False))
    for index in (0, 7, 13):
        alone = _token_ids(smollm2_llm.generate([prompts[index]], GREEDY, use_tqdm=False))
        assert alone[0] == batched[index]


def test_small_token_budget_chunked_prefill_equals_large_budget(
    make_llm: Callable[..., LLM], smollm2_llm: LLM
) -> None:
    prompts = _mixed_prompts(6)
    large = _token_ids(smollm2_llm.generate(prompts, GREEDY, use_tqdm=False))
    small = make_llm(max_num_batched_tokens=24)
    assert _token_ids(small.generate(prompts, GREEDY, use_tqdm=False)) == large


def test_shared_200_token_prefix_computes_only_uncached_tokens(
    make_llm: Callable[..., LLM],
) -> None:
    llm = make_llm()
    tok = llm.tokenizer
    prefix = tok.encode("The history of the printing press. " * 40)[:200]
    first = prefix + tok.encode(" First question: who invented it?")
    second = prefix + tok.encode(" Second question: when did it spread to Asia?")
    llm.generate([first], GREEDY, use_tqdm=False)
    before = llm.engine.stats().prompt_tokens_computed
    reused = llm.generate([second], GREEDY, use_tqdm=False)[0]
    computed = llm.engine.stats().prompt_tokens_computed - before
    cached = 200 // 16 * 16
    assert reused.num_cached_tokens == cached
    assert computed == len(second) - cached
    uncached_llm = make_llm(enable_prefix_caching=False)
    plain = uncached_llm.generate([second], GREEDY, use_tqdm=False)[0]
    assert reused.outputs[0].token_ids == plain.outputs[0].token_ids
    assert uncached_llm.engine.stats().prompt_tokens_computed == len(second)


def test_kv_pool_too_small_preempts_and_every_request_finishes_unchanged(
    make_llm: Callable[..., LLM], smollm2_llm: LLM
) -> None:
    prompts = _mixed_prompts(8)
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    large = smollm2_llm.generate(prompts, params, use_tqdm=False)
    tiny = make_llm(num_kv_blocks=24, enable_prefix_caching=False)
    small = tiny.generate(prompts, params, use_tqdm=False)
    assert tiny.engine.stats().num_preemptions > 0
    assert all(o.finished and len(o.outputs[0].token_ids) == 48 for o in small)
    assert _token_ids(small) == _token_ids(large)
    assert tiny.engine.stats().num_free_blocks == 24


def test_a_cpu_kv_pool_is_zero_and_costs_memory_only_where_written() -> None:
    """A large CPU pool lies in lazily zeroed anonymous memory (model_runner.zeroed): it reads
    as zeros, takes writes, and its untouched pages are not resident."""
    import os

    import torch

    from splitserve.engine.model_runner import LAZY_ZERO_BYTES, zeroed

    def resident_kib() -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024

    before = resident_kib()
    pool = zeroed((64, 16, 2, 8, 1024), torch.float32, torch.device("cpu"))  # 512 MiB
    assert pool.numel() * 4 >= LAZY_ZERO_BYTES
    pool[3, 5] = 1.5
    assert float(pool[3, 5].sum()) == 1.5 * 2 * 8 * 1024
    assert not pool[:3].any() and not pool[4:].any()
    grown_kib = resident_kib() - before
    assert grown_kib < 16 << 10, f"{grown_kib} KiB resident for a 512 MiB pool"
    small = zeroed((4, 4), torch.float16, torch.device("cpu"))
    assert small.dtype == torch.float16 and not small.any()
