"""A prompt's attention on the CPU on SmolLM2-135M's shape, one layer: its rows as decode rows
in one call (deterministic mode's prefill: kernels/native/decode_rows.c), the same rows one per
call (decode.c's one-row walk, which gives each row the same bits), and prefill.c's causal
kernel (the default mode's prefill, another order) on the same queries, keys and values.

Best of --repeats, in the main thread's CPU time (run with OMP_NUM_THREADS=1); per kernel,
milliseconds a layer and nanoseconds a score (query head and key). Prints JSON.

OMP_NUM_THREADS=1 python -m benchmarks.kernels.native_prompt_rows
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from splitserve.bench.report import git_commit
from splitserve.kernels.native.decode import decode_attention, prefill_attention

HEADS, KV_HEADS, DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M


def best_time(run: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        begin = time.thread_time()
        run()
        best = min(best, time.thread_time() - begin)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    n = args.tokens
    gen = torch.Generator().manual_seed(0)
    pool = 2 * -(-n // BLOCK)
    k_cache = torch.randn(pool, BLOCK, KV_HEADS, DIM, generator=gen)
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(pool, generator=gen)[: -(-n // BLOCK)]
    tables = table.repeat(n, 1)
    qkv = torch.randn(n, (HEADS + 2 * KV_HEADS) * DIM, generator=gen)
    positions = torch.arange(n)
    slots = table[positions // BLOCK] * BLOCK + positions % BLOCK
    angles = torch.arange(n)[:, None] * torch.rand(DIM, generator=gen)
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    out = torch.empty(n, HEADS, DIM)
    scale = DIM**-0.5

    def rows(at: slice) -> None:
        decode_attention(
            qkv[at], positions[at], cos, sin, k_cache, v_cache, slots[at], tables[at],
            positions[at] + 1, HEADS, scale, out[at],
        )  # fmt: skip

    q = qkv[:, : HEADS * DIM].view(n, HEADS, DIM)
    keys, values = (torch.randn(n, KV_HEADS, DIM, generator=gen) for _ in range(2))
    seconds = {
        "decode_rows_one_call": best_time(lambda: rows(slice(None)), args.repeats),
        "decode_row_per_call": best_time(
            lambda: [rows(slice(i, i + 1)) for i in range(n)], max(1, args.repeats // 3)
        ),
        "prefill_c": best_time(lambda: prefill_attention(q, keys, values, scale), args.repeats),
    }
    scores = HEADS * n * (n + 1) // 2
    print(json.dumps({
        "ms_per_layer": {name: s * 1e3 for name, s in seconds.items()},
        "ns_per_score": {name: s * 1e9 / scores for name, s in seconds.items()},
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
