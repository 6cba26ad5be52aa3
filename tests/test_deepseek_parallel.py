"""DeepSeek-V3 with expert parallelism on CPU: 2 engine processes of a Gloo group,
the routed experts sharded over them (the shared experts on every rank), rebalanced by EPLB
every 3 steps, generate the greedy tokens of one engine with every expert. (A served group of
4 ranks: tests/test_expert_parallel_serving.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from splitserve.engine.config import EPLBConfig
from tests.support.ep_worker import one_engine_tokens, run_group
from tests.support.tiny_models import tiny_deepseek_v3, tiny_deepseek_v4

PROMPTS = [[[11, 400, 23, 5000, 7], [901, 902, 903]], [[31000, 17, 2], [42] * 12]]
MAX_TOKENS = [10, 4]  # rank 1 runs out of work first and idles through the MoE exchanges


def test_ep2_tokens_equal_one_engine_while_eplb_moves_experts(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    expected = one_engine_tokens(path, PROMPTS, MAX_TOKENS)
    placements = [{}, {"eplb": EPLBConfig(interval_steps=3, redundant_experts=2)}]
    got = run_group(2, path, PROMPTS, MAX_TOKENS, placements)
    for rank in range(2):
        assert got[rank][0] == {0: expected[rank], 1: expected[rank]}
    # 10 steps (rank 0's longest request): 3 rebalances, alike on both ranks; each of the 2
    # MoE layers ends with 8 + 2 slots, every expert held.
    rebalances, slots = got[0][1][1]
    assert rebalances == 3 and got[1][1][1] == (rebalances, slots)
    assert len(slots) == 2
    for layer in slots:
        held = sorted({e for rank_slots in layer for e in rank_slots})
        assert held == list(range(8)) and sum(len(s) for s in layer) == 10


def test_v4_ep2_tokens_equal_one_engine(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    """DeepSeek-V4 (hash-routed first layer, top-k after) at expert parallelism 2, with
    EPLB moving experts every 3 steps: prompts past several windows and entries."""
    _, path = tiny_deepseek_v4(smollm2_tokenizer, tmp_path / "v4")
    prompts = [[list(range(100, 137)), [901, 902, 903]], [list(range(7, 29))]]
    expected = one_engine_tokens(path, prompts, MAX_TOKENS)
    placements = [{"eplb": EPLBConfig(interval_steps=3, redundant_experts=2)}]
    got = run_group(2, path, prompts, MAX_TOKENS, placements)
    assert [got[rank][0] for rank in range(2)] == [{0: expected[rank]} for rank in range(2)]
    assert got[0][1][0][0] == 3  # rebalances over rank 0's 10 steps
