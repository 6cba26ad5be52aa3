"""The paged MLA decode kernel against its torch reference on one GPU (DeepSeek-V3's
attention shape: 128 heads, a 512 + 64 latent per token, bfloat16).

    python3 -m benchmarks.kernels.mla_decode --batch 64 --contexts 1024,4096,16384,32768

Checks the kernel against ``engine/layers/mla.py: mla_decode`` (exits 1 on a mismatch) and
prints one JSON line: per context the kernel's time in µs at its default tile (key 0) and at
16, 32 and 64 tokens a tile, the reference's, and the
kernel's share of the bandwidth bound of the latent cache it reads (batch x context x 576 x 2
bytes at the copy bandwidth measured in the same run: 4.24 TB/s on an H200); written to
$OUT/mla-decode.json when OUT is set. Target (issue 41): >= 70% at batch 64 and 4k context.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.report import git_commit
from splitserve.bench.roofline import measure_ceilings
from splitserve.engine.layers.mla import mla_decode
from splitserve.kernels.mla_decode import mla_decode_attention

HEADS, LORA, ROPE, BLOCK_SIZE = 128, 512, 64, 16
BANDWIDTH = 4.24e12
"""The copy bandwidth the shares are taken against: the H200's measured 4.24 TB/s until
``main`` measures the GPU it runs on (``bench/roofline.py: measure_ceilings``)."""
MATMUL_RATE = 790e12
DEV = torch.device("cuda")


def time_us(fn: Any, iters: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def case(batch: int, context: int, heads: int = HEADS) -> tuple[torch.Tensor, ...]:
    """(query, latent cache, block tables, context lengths) of random bf16 values, every
    sequence ``context`` tokens long in scattered blocks."""
    blocks = -(-context // BLOCK_SIZE)
    cache = torch.randn(batch * blocks + 1, BLOCK_SIZE, 1, LORA + ROPE, device=DEV).bfloat16()
    tables = torch.randperm(batch * blocks, device=DEV).view(batch, blocks)
    lens = torch.full((batch,), context, device=DEV)
    query = torch.randn(batch, heads, LORA + ROPE, device=DEV).bfloat16()
    return query, cache, tables, lens


SCALE = (128 + ROPE) ** -0.5


def compute_bound_us(batch: int, context: int, heads: int) -> float:
    """The tensor cores' floor: per head and token a 576-wide score and a 512-wide weighted
    sum (two FLOPs a multiply-add) at the bfloat16 rate measured on an H200 (790 TFLOP/s)."""
    return batch * context * heads * 2 * (LORA + ROPE + LORA) / MATMUL_RATE * 1e6


def one(batch: int, context: int, heads: int = HEADS) -> dict[str, Any]:
    query, cache, tables, lens = case(batch, context, heads)
    scale = SCALE
    got = mla_decode_attention(query, cache, tables, lens, scale, LORA)
    ref = mla_decode(query.float(), cache.float(), tables, lens, scale, LORA)
    err = float((got.float() - ref).abs().max())

    def run(block_n: int | None) -> Any:
        return lambda: mla_decode_attention(
            query, cache, tables, lens, scale, LORA, block_n=block_n
        )

    kernel = {n or 0: time_us(run(n)) for n in (None, 16, 32, 64)}
    torch_us = time_us(lambda: mla_decode(query, cache, tables, lens, scale, LORA), iters=5)
    read = batch * context * (LORA + ROPE) * 2
    floor = compute_bound_us(batch, context, heads)
    return {
        "batch": batch, "context": context, "heads": heads, "max_abs_err": err,
        "ok": err < 2e-2, "kernel_us_by_block_n": kernel, "torch_us": torch_us,
        "kernel_bandwidth_share": read / (kernel[0] * 1e-6) / BANDWIDTH,
        "compute_bound_us": floor, "bandwidth_bound_us": read / BANDWIDTH * 1e6,
        "kernel_share_of_larger_bound": max(floor, read / BANDWIDTH * 1e6) / kernel[0],
    }  # fmt: skip


def sweep(
    batch: int,
    context: int,
    heads: str,
    warps: str,
    tokens: str,
    splits: str,
    stages: str,
    query_heads: int = HEADS,
) -> list[dict[str, Any]]:
    """The kernel's time at each launch shape (heads a program, warps, tokens a tile, splits
    of the context, pipeline stages; 0: the default) on one case; a shape Triton cannot
    compile (too much shared memory) is left out."""
    query, cache, tables, lens = case(batch, context, query_heads)
    scale = SCALE
    ref = mla_decode(query.float(), cache.float(), tables, lens, scale, LORA)
    read = batch * context * (LORA + ROPE) * 2
    rows = []
    for block_h, num_warps, block_n, num_splits, num_stages in itertools.product(
        *(list(map(int, values.split(","))) for values in (heads, warps, tokens, splits, stages))
    ):
        if block_h > max(16, query_heads):
            continue
        tiles = {
            "block_n": block_n, "block_h": block_h, "num_warps": num_warps,
            "num_splits": num_splits or None, "num_stages": num_stages or None,
        }  # fmt: skip

        def run(tiles: dict[str, Any] = tiles) -> Any:
            return mla_decode_attention(query, cache, tables, lens, scale, LORA, **tiles)

        try:
            err = float((run().float() - ref).abs().max())
            us = time_us(run)
        except Exception as exc:  # out of resources: not a candidate
            print(f"{tiles}: {exc!r:.120}")
            continue
        rows.append({
            **tiles, "us": us, "max_abs_err": err,
            "bandwidth_share": read / (us * 1e-6) / BANDWIDTH,
        })  # fmt: skip
    return sorted(rows, key=lambda r: r["us"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--heads", default="128", help="query heads, comma-separated")
    parser.add_argument("--contexts", default="1024,4096,16384,32768")
    parser.add_argument("--sweep", type=int, default=0, help="also sweep tiles at this context")
    parser.add_argument("--sweep-heads", default="16,32,64,128", help="BLOCK_H values")
    parser.add_argument("--sweep-warps", default="4,8,16")
    parser.add_argument("--sweep-tokens", default="16,32,64,128", help="BLOCK_N values")
    parser.add_argument("--sweep-splits", default="0", help="splits of the context (0: default)")
    parser.add_argument("--sweep-stages", default="0", help="pipeline stages (0: Triton's)")
    parser.add_argument("--sweep-query-heads", type=int, default=HEADS, help="the case's heads")
    args = parser.parse_args()
    global BANDWIDTH, MATMUL_RATE
    ceilings = measure_ceilings(DEV, torch.bfloat16)
    BANDWIDTH, MATMUL_RATE = ceilings.bandwidth_bytes_per_s, ceilings.matmul_flops_per_s
    rows = [
        one(args.batch, int(c), int(h))
        for h in args.heads.split(",")
        for c in args.contexts.split(",")
    ]
    device = torch.cuda.get_device_name()
    result: dict[str, Any] = {
        "commit": git_commit(), "device": device, "bandwidth": BANDWIDTH,
        "matmul_rate": MATMUL_RATE, "rows": rows,
    }  # fmt: skip
    if args.sweep:
        tiles = sweep(
            args.batch,
            args.sweep,
            args.sweep_heads,
            args.sweep_warps,
            args.sweep_tokens,
            args.sweep_splits,
            args.sweep_stages,
            args.sweep_query_heads,
        )
        result["sweep"] = tiles
        for r in tiles[:8]:
            print(r)
    line = json.dumps(result)
    print(line)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "mla-decode.json").write_text(line + "\n")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
