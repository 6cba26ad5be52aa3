"""Expert parallelism on CPU: two engine processes of a Gloo group, each with its own
requests, the tiny Mixtral's experts sharded over them (contiguously, and by an EPLB
placement with replicated experts serving uneven shares and an empty slot), generate the
same greedy tokens as one engine with every expert."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from splitserve.engine.config import EPLBConfig
from splitserve.eplb.rebalance import rebalance
from tests.support import processes
from tests.support.ep_worker import move_in_group, one_engine_tokens, run_group
from tests.support.server_process import free_port
from tests.support.tiny_models import tiny_model

PROMPTS = [
    [[11, 400, 23, 5000, 7], [901, 902, 903], [42] * 12],
    [[31000, 17, 2]],
]
MAX_TOKENS = [12, 5]  # rank 1 runs out of work first and idles through the MoE exchanges


def test_ep2_tokens_equal_ep1(smollm2_tokenizer: Any, tmp_path: Path) -> None:
    _, path = tiny_model(
        smollm2_tokenizer, tmp_path / "mixtral", "mixtral", seed=5, num_local_experts=8
    )
    expected = one_engine_tokens(path, PROMPTS, MAX_TOKENS)
    placement = rebalance(torch.tensor([9.0, 1, 1, 3, 1, 1, 0.5, 0.5]), 2, 3, policy="global")
    assert int((placement.slots < 0).sum()) == 1 and int(placement.replicas(8).max()) > 1
    placements = [
        {},
        {
            "expert_slots": tuple(map(tuple, placement.slots.tolist())),
            "expert_shares": tuple(map(tuple, placement.shares.tolist())),
        },
        # EPLB while generating: every 3 steps the experts move, with 2 redundant copies.
        {"eplb": EPLBConfig(interval_steps=3, redundant_experts=2)},
    ]
    got = run_group(2, path, PROMPTS, MAX_TOKENS, placements)
    for rank in range(2):
        assert got[rank][0] == {0: expected[rank], 1: expected[rank], 2: expected[rank]}
    # 12 steps (rank 0's longest request) and 4 rebalances, on both ranks alike; each layer
    # ends with 10 slots (8 experts + 2 copies) in 5 per rank, one expert held twice.
    (rebalances, slots), other = got[0][1][2], got[1][1][2]
    assert rebalances == 4 and other == (rebalances, slots)
    for layer in slots:
        held = torch.tensor(layer).flatten()
        assert len(layer[0]) == 5 and sorted(set(held.tolist())) == list(range(8))
        assert int(torch.bincount(held).max()) >= 2


def test_a_move_where_one_rank_sends_nothing() -> None:
    """Rank 1 takes experts 2 and 3 from rank 2 and nobody takes its copies of 0 and 1 (rank 2
    takes theirs from rank 0, the first holder): rank 1 sends no row (a served group once
    failed there). Every rank ends with its new experts' weights."""
    old = [[0, 1], [0, 1], [2, 3]]
    new = [[0, 1], [2, 3], [0, 1]]
    context = processes.context()
    results = context.Queue()
    args = (3, free_port(), old, new, results)
    workers = [context.Process(target=move_in_group, args=(rank, *args)) for rank in range(3)]
    for worker in workers:
        worker.start()
    got = dict(results.get(timeout=120) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    for rank in range(3):
        assert got[rank] == [[float(e) for e in new[rank]]] * 2
