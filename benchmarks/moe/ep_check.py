"""Expert parallelism over NCCL, one process per GPU: the MoE layer of an expert-parallel group
against the same layer with every expert on one GPU, before and after an EPLB rebalance that
moves the expert weights between the GPUs (engine/expert_rebalance.py).

Each rank builds the same layer (same seed: gate, all experts), keeps the experts of its
slots, forms its group through a TCPStore the way a worker does (``collective_group``, backend
by device: NCCL), routes its own tokens and runs ``ExpertParallel.run``; rank 0 compares every
rank's output with the one-GPU layer on that rank's tokens. Then the group rebalances on a
skewed load (2 redundant copies) and runs again. Last, every rank times the group's
all-to-all (``all_to_all_single``, bf16 rows of 2,048 and 7,168 values split evenly over the
ranks) at several row counts; the slowest rank's time per point goes to $OUT/a2a.json, which
``splitserve bench eplb --a2a-costs`` fits. Prints one JSON line (and writes it to
$OUT/ep-nccl-check.json); exit 1 on a mismatch.

    python3 -m benchmarks.moe.ep_check            # every visible GPU, at least 2
    python3 -m benchmarks.moe.ep_check            # without a GPU: 2 processes over Gloo
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from splitserve.engine.expert_rebalance import move_experts
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.model_config import MoEConfig
from splitserve.eplb.rebalance import rebalance
from splitserve.kvstore.transfer import StoreAddress, collective_group, start_store

HIDDEN, EXPERTS, TOP_K, INTER, TOKENS = 256, 16, 4, 128, 96


def layer(device: torch.device, ep: ExpertParallel | None) -> SparseMoE:
    """The same layer on every rank: all experts drawn from seed 0, then this rank's kept."""
    torch.manual_seed(0)
    moe = MoEConfig(num_experts=EXPERTS, top_k=TOP_K, intermediate_size=INTER, renormalize=True)
    full = SparseMoE(HIDDEN, moe).to(device, torch.bfloat16)
    if ep is None:
        return full
    part = SparseMoE(HIDDEN, moe, ep).to(device, torch.bfloat16)
    with torch.no_grad():
        part.gate.weight.copy_(full.gate.weight)
        slots = torch.tensor(ep.local_slots, device=device)
        part.w13.copy_(full.w13[slots])
        part.w2.copy_(full.w2[slots])
    return part


def tokens(rank: int, device: torch.device) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + rank)
    return torch.randn(TOKENS + 7 * rank, HIDDEN, generator=generator).to(device, torch.bfloat16)


def rank_device(rank: int) -> torch.device:
    if not torch.cuda.is_available():
        return torch.device("cpu")
    torch.cuda.set_device(rank)
    return torch.device("cuda", rank)


def run_rank(rank: int, size: int, address: StoreAddress, results: Any) -> None:
    device = rank_device(rank)
    group = collective_group(address, "ep/check/0", rank, size, device)
    ep = ExpertParallel.contiguous(rank, size, EXPERTS)
    ep = ExpertParallel(ep.rank, ep.size, ep.slots, ep.shares, group)
    moe = layer(device, ep)
    h = tokens(rank, device)
    with torch.no_grad():
        before = moe.experts(h).float().cpu()
        # A skewed load: expert 3 the hottest; 2 redundant copies.
        load = torch.ones(EXPERTS, dtype=torch.float64)
        load[3], load[7] = 40.0, 12.0
        placement = rebalance(load, size, 2, policy="global")
        new = ExpertParallel(rank, size, placement.slots, placement.shares, group)
        move_experts(moe, new)
        after = moe.experts(h).float().cpu()
    results.put((rank, before, after, placement.slots.tolist(), time_all_to_all(new, device)))


def time_all_to_all(ep: ExpertParallel, device: torch.device) -> list[dict[str, float]]:
    """Microseconds per all-to-all of ``rows`` bf16 rows sent by this rank, split evenly over
    the ranks, through the engine's own call (``ExpertParallel.all_to_all``), after 3 warm-up
    calls, mean of 20; CPU (Gloo) only the small sizes."""
    cuda = device.type == "cuda"
    points = []
    for hidden in (2048, 7168) if cuda else (2048,):
        for rows in (8, 64, 256, 1024, 4096) if cuda else (8, 64, 256):
            rows = -(-rows // ep.size) * ep.size
            splits = [rows // ep.size] * ep.size
            x = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
            out = torch.empty_like(x)
            for _ in range(3):
                ep.all_to_all(out, x, splits, splits)
            ep.counts(torch.ones(ep.size, dtype=torch.int64, device=device))  # line up
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(20):
                ep.all_to_all(out, x, splits, splits)
            if cuda:
                torch.cuda.synchronize(device)
            us = (time.perf_counter() - start) / 20 * 1e6
            points.append({"rows": rows, "hidden": hidden, "us": us})
    return points


def main() -> int:
    size = torch.cuda.device_count() if torch.cuda.is_available() else 2
    if size < 2:
        print("needs at least 2 GPUs")
        return 1
    store, address = start_store("127.0.0.1")
    context = mp.get_context("spawn")
    results = context.Queue()
    procs = [
        context.Process(target=run_rank, args=(r, size, address, results)) for r in range(size)
    ]
    for p in procs:
        p.start()
    got = {rank: (b, a, s, t) for rank, b, a, s, t in (results.get(timeout=300) for _ in procs)}
    for p in procs:
        p.join(timeout=60)
    reference = layer(rank_device(0), None)
    rows: list[dict[str, Any]] = []
    ok = all(p.exitcode == 0 for p in procs)
    with torch.no_grad():
        for rank in range(size):
            ref = reference.experts(tokens(rank, rank_device(0))).float().cpu()
            before, after, _, _ = got[rank]
            scale = float(ref.abs().max())
            err_before = float((before - ref).abs().max()) / scale
            err_after = float((after - ref).abs().max()) / scale
            ok &= err_before < 2e-2 and err_after < 2e-2
            rows.append({"rank": rank, "err_before": err_before, "err_after": err_after})
    a2a = [
        point | {"us": max(got[rank][3][i]["us"] for rank in range(size))}
        for i, point in enumerate(got[0][3])
    ]
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    commit = os.environ.get("SPLITSERVE_GIT_COMMIT", "unknown")
    timing = {"bench": "all_to_all", "world_size": size, "device": device, "rows": a2a}
    result = {
        "check": "ep-nccl",
        "ok": ok,
        "ranks": size,
        "placement_after": got[0][2],
        "rows": rows,
        "all_to_all": a2a,
        "device": device,
        "git_commit": commit,
    }
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "ep-nccl-check.json").write_text(line + "\n")
        timing["git_commit"] = commit
        Path(os.environ["OUT"], "a2a.json").write_text(json.dumps(timing) + "\n")
    del store
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
