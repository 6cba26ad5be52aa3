"""KV cache groups for sliding-window models (engine/hybrid_blocks.py): the window layers
hold only their window, outputs stay those of a full cache, the handoff carries both
groups, and a prefix hit replays the window (exactly, or bounded)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.hybrid_blocks import HybridBlockManager
from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.kv_groups import pool_sizes
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import Request
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.warm_up import warm_up
from tests.support.handoff import disaggregated
from tests.support.reference import assert_greedy_equal
from tests.support.tiny_models import tiny_gemma3

WINDOW = 8
BLOCK = 8
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, str]:
    return tiny_gemma3(smollm2_tokenizer, tmp_path_factory.mktemp("gemma3") / "m", WINDOW)


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (9, 70, 301)]


def engine(path: str, tokenizer: Any, **overrides: Any) -> LLMEngine:
    overrides.setdefault("max_num_batched_tokens", 64)
    overrides.setdefault("kv_cache_bytes", 1 << 22)
    config = EngineConfig(model=path, max_model_len=1024, block_size=BLOCK, **overrides)
    return LLMEngine(config, tokenizer=tokenizer)


def test_a_window_table_frees_its_blocks_behind_the_window() -> None:
    manager = HybridBlockManager(32, 4, False, 0, [(8, 8)], allowance=None)
    req = Request("r", list(range(30)), GREEDY)
    assert manager.allocate_slots(req, 12)
    assert (req.block_table, req.window_tables) == ([0, 1, 2], [[0, 1, 2]])
    req.num_computed_tokens = 12  # the next query, position 12, reads positions 5 .. 12
    assert manager.allocate_slots(req, 1)
    assert (req.block_table, req.window_tables) == ([0, 1, 2, 3], [[8, 1, 2, 0]])
    req.num_computed_tokens = 13
    assert manager.allocate_slots(req, 11)  # positions 13 .. 23 read 6 .. 23
    assert req.window_tables == [[8, 1, 2, 0, 3, 4]]
    assert manager.window_blocks_in_use() == [5]
    manager.trim(req, 16)
    assert (req.block_table, req.window_tables) == ([0, 1, 2, 3], [[8, 1, 2, 0]])
    manager.free(req)
    assert manager.window_blocks_in_use() == [0] and manager.num_free_blocks == 32


def test_a_window_pool_out_of_blocks_refuses_without_claiming_group_0() -> None:
    manager = HybridBlockManager(32, 4, False, 0, [(2, 8)], allowance=None)
    req = Request("r", list(range(30)), GREEDY)
    assert not manager.allocate_slots(req, 12)  # 3 window blocks, 2 in the pool
    assert req.block_table == [] and manager.num_free_blocks == 32


def test_a_prefix_hit_replays_the_window_and_allowance_from_a_block_boundary() -> None:
    bounded = HybridBlockManager(32, 4, True, 0, [(16, 8)], allowance=3)
    assert [bounded.replay_start(n) for n in (0, 8, 11, 12, 40)] == [0, 0, 0, 0, 28]
    exact = HybridBlockManager(32, 4, True, 0, [(16, 8)], allowance=None)
    assert exact.replay_start(40) == 0
    assert bounded.adopted_window_from(30) == 20  # the query at 30 reads 23 .. 30


def test_a_long_request_holds_a_window_of_local_kv_and_equals_the_full_cache(
    tiny: tuple[Any, str], smollm2_tokenizer: Any, prompts: list[list[int]]
) -> None:
    hf_model, path = tiny
    hybrid = engine(path, smollm2_tokenizer)
    assert len(hybrid.runner.kv_groups) == 2
    assert hybrid.runner.kv_groups[1].layers == (0, 1, 2, 3, 4, 6)
    hybrid.add_request("long", prompts[2], GREEDY)
    held = []
    tokens: list[int] = []
    while hybrid.has_unfinished_requests():
        for output in hybrid.step():
            tokens = output.outputs[0].token_ids
        req = hybrid.requests.get("long")
        if req is not None:
            held.append(sum(b != hybrid.runner.window_blocks[0] for b in req.window_tables[0]))
    # A 64-token chunk reads 7 positions before it: at most 9 blocks of 8; a decode step 2.
    assert max(held) <= 9 and held[-1] <= 2
    full = engine(path, smollm2_tokenizer, hybrid_kv_cache=False)
    assert len(full.runner.kv_groups) == 1
    plain = LLM.from_engine(full).generate([prompts[2]], GREEDY, use_tqdm=False)
    assert tokens == plain[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([prompts[2]]), max_new_tokens=24, do_sample=False, pad_token_id=0
        )[0, 301:].tolist()
    assert_greedy_equal(hf_model, prompts[2], tokens, ref)


def test_the_handoff_carries_both_groups_and_equals_colocated(
    tiny: tuple[Any, str], smollm2_tokenizer: Any, prompts: list[list[int]]
) -> None:
    _, path = tiny
    colocated = LLM.from_engine(engine(path, smollm2_tokenizer))
    expected = [o.outputs[0].token_ids for o in colocated.generate(prompts, GREEDY, False)]
    prefill, decode = engine(path, smollm2_tokenizer), engine(path, smollm2_tokenizer)
    tokens = disaggregated(prefill, decode, prompts, GREEDY)
    assert [tokens[str(i)] for i in range(len(prompts))] == expected
    shape = prefill.handoff.transfer_shape(301)
    # 38 blocks of the global layer's K and V, the last 2 blocks (positions 288 .. 303) of
    # the 6 local layers': one KV head of 32.
    assert shape == ((1 * 38 + 6 * 2) * 2 * BLOCK * 32,)


def test_exact_replay_of_a_prefix_hit_equals_the_uncached_run(
    tiny: tuple[Any, str], smollm2_tokenizer: Any, prompts: list[list[int]]
) -> None:
    _, path = tiny
    follow_up = prompts[2] + prompts[1][:20]
    cached = engine(path, smollm2_tokenizer)
    llm = LLM.from_engine(cached)
    llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    second = llm.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 0  # exact: the whole prefix replayed
    assert cached.block_manager.last_hit_tokens == {}  # no tier saved a token
    uncached = LLM.from_engine(engine(path, smollm2_tokenizer, enable_prefix_caching=False))
    plain = uncached.generate([follow_up], GREEDY, use_tqdm=False)[0]
    assert second.outputs[0].token_ids == plain.outputs[0].token_ids


def test_bounded_replay_computes_the_window_and_allowance_and_keeps_the_cached_kv(
    tiny: tuple[Any, str], smollm2_tokenizer: Any, prompts: list[list[int]]
) -> None:
    _, path = tiny
    cached = engine(path, smollm2_tokenizer, window_replay_allowance=8)
    llm = LLM.from_engine(cached)
    llm.generate([prompts[2]], GREEDY, use_tqdm=False)
    table = list(cached.block_manager.cached.values())
    before = cached.runner.gather_blocks(table).clone()
    second = llm.generate([prompts[2] + prompts[1][:20]], GREEDY, use_tqdm=False)[0]
    assert second.num_cached_tokens == 280  # 296 cached, less the window and allowance
    assert cached.block_manager.last_hit_tokens == {"device": 280}
    assert len(second.outputs[0].token_ids) == GREEDY.max_tokens
    assert torch.equal(cached.runner.gather_blocks(table), before)


def test_warm_up_and_dynamic_speculation_step_the_window_groups(
    tiny: tuple[Any, str], smollm2_tokenizer: Any, prompts: list[list[int]]
) -> None:
    """The warm-up (every CUDA engine's start) and the step-time curve of dynamic
    speculation run steps of their own: the window layers get their groups' metadata too;
    verify rows read the window and equal plain decoding."""
    _, path = tiny
    spec = SpeculativeConfig("ngram", 3, prompt_lookup_min=1)
    speculating = engine(path, smollm2_tokenizer, speculative=spec, max_num_seqs=2)
    assert warm_up(speculating.runner, 2, 16) >= 0.0
    prompt = (prompts[1][:12] * 5)[:60]  # repeats: the n-gram lookup finds drafts
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    tokens = LLM.from_engine(speculating).generate([prompt], params, use_tqdm=False)
    assert speculating.spec is not None and speculating.spec.counters.num_drafts > 0
    plain = LLM.from_engine(engine(path, smollm2_tokenizer, max_num_seqs=2))
    expected = plain.generate([prompt], params, use_tqdm=False)
    assert tokens[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def test_a_request_that_fits_group_0_fits_a_window_pool_its_budget_capped() -> None:
    """A tiny budget caps the window pool below what its requests could hold: group 0 gets no
    more blocks than it, or a prompt admitted by group 0 could never run (a hang); with
    num_kv_blocks, the window pools come from it, not from kv_cache_bytes."""
    local = KVCacheGroup(KVCacheSpec(2, 6, 1, 32), (0, 1, 2, 3, 4, 6), WINDOW)
    groups = [KVCacheGroup(KVCacheSpec(2, 1, 1, 32), (5,)), local]
    block = 2 * 32 * 4 * BLOCK  # float32 bytes of one layer's block
    budget = 7 * block * 4 + 5 * block  # 4 blocks of all 7 layers, 5 of one layer left over
    assert pool_sizes(groups, budget, BLOCK, 4, 64, 64) == [4, 4]
    assert pool_sizes(groups, 1 << 30, BLOCK, 4, 2, 64) == [524204, 14]  # 2 * 24 + 64 tokens
    assert pool_sizes(groups, budget, BLOCK, 4, 2, 64, num_blocks=100) == [100, 14]
    assert pool_sizes(groups, budget, BLOCK, 4, 64, 64, num_blocks=100) == [100, 100]
