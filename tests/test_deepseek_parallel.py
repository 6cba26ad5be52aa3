"""DeepSeek-V3 with expert parallelism on CPU: 2 engine processes of a Gloo group,
the routed experts sharded over them (the shared experts on every rank), rebalanced by EPLB
every 3 steps, generate the greedy tokens of one engine with every expert. (A served group of
4 ranks: tests/test_expert_parallel_serving.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from splitserve import LLM, SamplingParams
from splitserve.engine.config import EPLBConfig
from tests.support.ep_worker import generate_in_group
from tests.support.server_process import free_port
from tests.support.tiny_models import tiny_deepseek_v3

PROMPTS = [[[11, 400, 23, 5000, 7], [901, 902, 903]], [[31000, 17, 2], [42] * 12]]
MAX_TOKENS = [10, 4]  # rank 1 runs out of work first and idles through the MoE exchanges


def test_ep2_tokens_equal_one_engine_while_eplb_moves_experts(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    size = 2
    _, path = tiny_deepseek_v3(smollm2_tokenizer, tmp_path / "v3")
    llm = LLM(model=path, max_model_len=256, block_size=8)
    expected = [
        [
            o.outputs[0].token_ids
            for o in llm.generate(
                prompts,
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )
        ]
        for prompts, n in zip(PROMPTS[:size], MAX_TOKENS[:size])
    ]
    placements = [{}, {"eplb": EPLBConfig(interval_steps=3, redundant_experts=size)}]
    context = mp.get_context("spawn")
    results = context.Queue()
    args = (size, free_port(), path, PROMPTS[:size], MAX_TOKENS[:size], placements, results)
    workers = [context.Process(target=generate_in_group, args=(r, *args)) for r in range(size)]
    for worker in workers:
        worker.start()
    got = {
        rank: (tokens, moved) for rank, tokens, moved in (results.get(timeout=180) for _ in workers)
    }
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    for rank in range(size):
        assert got[rank][0] == {0: expected[rank], 1: expected[rank]}
    # 10 steps (rank 0's longest request): 3 rebalances, alike on every rank; each of the 2
    # MoE layers ends with 8 + size slots, every expert held.
    rebalances, slots = got[0][1][1]
    assert rebalances == 3 and all(got[r][1][1] == (rebalances, slots) for r in range(size))
    assert len(slots) == 2
    for layer in slots:
        held = sorted({e for rank_slots in layer for e in rank_slots})
        assert held == list(range(8)) and sum(len(s) for s in layer) == 8 + size
