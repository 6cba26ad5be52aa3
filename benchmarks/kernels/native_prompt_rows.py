"""A prompt's attention on the CPU on SmolLM2-135M's shape, one layer: its rows as decode rows
in one call (deterministic mode's prefill: kernels/native/decode_rows.c), the same rows in one
call last first (no run of rising contexts, so decode.c's one-row walk for each, which gives
each row the same bits), and prefill.c's causal kernel (the default mode's prefill, another
order) on the same queries, keys and values.

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
    scale = DIM**-0.5

    def rows(order: torch.Tensor, out: torch.Tensor) -> Callable[[], None]:
        """A call with the rows in this order (its inputs taken before it is timed)."""
        ins = [t[order].contiguous() for t in (qkv, positions, slots, tables)]
        return lambda: decode_attention(
            ins[0], ins[1], cos, sin, k_cache, v_cache, ins[2], ins[3], ins[1] + 1, HEADS,
            scale, out,
        )  # fmt: skip

    q = qkv[:, : HEADS * DIM].view(n, HEADS, DIM)
    keys, values = (torch.randn(n, KV_HEADS, DIM, generator=gen) for _ in range(2))
    runs, last_first = torch.empty(n, HEADS, DIM), torch.empty(n, HEADS, DIM)
    seconds = {
        "decode_rows_c": best_time(rows(torch.arange(n), runs), args.repeats),
        "decode_c_row_by_row": best_time(rows(torch.arange(n).flip(0), last_first), args.repeats),
        "prefill_c": best_time(lambda: prefill_attention(q, keys, values, scale), args.repeats),
    }
    scores = HEADS * n * (n + 1) // 2
    print(json.dumps({
        "ms_per_layer": {name: s * 1e3 for name, s in seconds.items()},
        "ns_per_score": {name: s * 1e9 / scores for name, s in seconds.items()},
        "same_bits": torch.equal(runs, last_first.flip(0)),
        "args": vars(args),
        "threads": torch.get_num_threads(),
        "commit": git_commit(),
    }, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
