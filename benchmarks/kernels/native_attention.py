"""The native decode attention (kernels/native/decode.c) on SmolLM2-135M's shape: one batch-32
decode step's attention over all 30 layers, each layer's KV cache a pool of its own with the
sequences' blocks scattered over it (as a server's pool is after a while), every sequence at
the same context length.

Times --steps steps, best of --repeats, per vector width (--lanes; 8,16 times both, which
give the same bits); the caches do not fit in the last-level cache (30
layers x 2 x 32 sequences x context x 768 bytes), so this measures the kernel with its reads
from memory. Threads are torch's (OMP_NUM_THREADS). Prints one line and writes JSON.

OMP_NUM_THREADS=2 python -m benchmarks.kernels.native_attention --output native_attention.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from splitserve.bench.report import git_commit
from splitserve.kernels.native.decode import decode_attention, set_attention_lanes

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=200)
    parser.add_argument("--layers", type=int, default=30, help="1 or 2: caches in the LLC")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--lanes",
        default="0",
        help="vector widths to time, comma-separated: 8, 16, or 0 (the CPU's default); "
        "8,16 compares the two paths in one run (the same bits)",
    )
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()

    per_seq = -(-(args.context + 1) // BLOCK)
    pool = 2 * args.batch * per_seq  # half of the pool in use, blocks anywhere in it
    generator = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(args.layers):
        k = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=generator)
        v = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=generator)
        tables = torch.randperm(pool, generator=generator)[: args.batch * per_seq]
        layers.append((k, v, tables.view(args.batch, per_seq)))
    width = (HEADS + 2 * KV_HEADS) * DIM
    qkv = torch.randn(args.batch, width, generator=generator)
    positions = torch.full((args.batch,), args.context, dtype=torch.int64)
    context_lens = positions + 1
    angles = torch.arange(args.context + 1)[:, None] * torch.rand(DIM, generator=generator)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    out = torch.empty(args.batch, HEADS, DIM)
    scale = DIM**-0.5

    def step() -> None:
        for k, v, tables in layers:
            slots = tables[:, args.context // BLOCK] * BLOCK + args.context % BLOCK
            decode_attention(
                qkv, positions, cos, sin, k, v, slots, tables, context_lens, HEADS, scale, out
            )

    cache_bytes = args.layers * 2 * args.batch * (args.context + 1) * KV_HEADS * DIM * 4
    timed = {}
    for lanes in (int(n) for n in args.lanes.split(",")):
        set_attention_lanes(lanes)
        step()
        best = float("inf")
        for _ in range(args.repeats):
            start = time.perf_counter()
            for _ in range(args.steps):
                step()
            best = min(best, (time.perf_counter() - start) / args.steps)
        timed[str(lanes)] = {
            "step_ms": round(best * 1e3, 2),
            "kv_read_gb_per_s": round(cache_bytes / best / 1e9, 2),
        }
    set_attention_lanes(0)
    result = {
        "config": {**vars(args), "output": None, "threads": torch.get_num_threads()},
        "commit": git_commit(),
        "lanes": timed,
    }
    print(json.dumps(result))
    if args.output:
        args.output.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
