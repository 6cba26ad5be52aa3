"""The paged decode attention over an FP8 KV cache against the same launch over bfloat16, on
Llama-3-8B's attention shape (32 query heads, 8 KV heads of 128), batch 64 (issue 42).

For each launch shape (tokens a tile, warps, splits; 0: the default) the FP8 cache's time and
its share of the bandwidth bound of the bytes it reads (rows of 128 e4m3 values and 16 bytes
of scale), beside bfloat16's default; the largest error of each against the bfloat16 launch
on the dequantized cache. A layer's decode at 4k and 8k context.

    python3 -m benchmarks.kernels.fp8_kv_decode   # on the GPU machine; $OUT/fp8-kv-decode.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
from pathlib import Path
from typing import Any

import torch
import triton.testing

from splitserve.bench.report import git_commit
from splitserve.bench.roofline import measure_ceilings
from splitserve.engine.layers.fp8_kv import pack_kv, unpack_kv
from splitserve.kernels.decode_attention import paged_decode_attention

HEADS, KV_HEADS, DIM, BLOCK_SIZE = 32, 8, 128, 16


def us(fn: Any) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=50)) * 1000


def case(batch: int, context: int, sweep: list[tuple[int, int, int]], bandwidth: float) -> dict:
    blocks = -(-context // BLOCK_SIZE)
    dev = torch.device("cuda")
    shape = (batch * blocks + 1, BLOCK_SIZE, KV_HEADS, DIM)
    k = torch.randn(shape, device=dev).bfloat16()
    v = torch.randn(shape, device=dev).bfloat16()
    k8, v8 = pack_kv(k), pack_kv(v)
    k_back, v_back = unpack_kv(k8, torch.bfloat16), unpack_kv(v8, torch.bfloat16)
    tables = torch.randperm(batch * blocks, device=dev).view(batch, blocks)
    lens = torch.full((batch,), context, device=dev)
    q = torch.randn(batch, HEADS, DIM, device=dev).bfloat16()
    scale = DIM**-0.5
    want = paged_decode_attention(q, k_back, v_back, tables, lens, scale).float()
    bf16_bytes = batch * context * KV_HEADS * DIM * 2 * 2
    fp8_bytes = batch * context * KV_HEADS * (DIM + 16) * 2
    bf16_us = us(lambda: paged_decode_attention(q, k, v, tables, lens, scale))
    rows = []
    for block_n, warps, splits in sweep:
        kwargs = {"block_n": block_n or None, "num_warps": warps, "num_splits": splits or None}
        try:
            got = paged_decode_attention(q, k8, v8, tables, lens, scale, **kwargs).float()
            t = us(
                lambda kwargs=kwargs: paged_decode_attention(
                    q, k8, v8, tables, lens, scale, **kwargs
                )
            )
        except Exception as exc:  # a shape past the shared memory or registers
            print(f"{kwargs}: {exc!r:.100}")
            continue
        rows.append({
            **kwargs, "us": t, "max_abs_err": float((got - want).abs().max()),
            "bandwidth_share": fp8_bytes / (t * 1e-6) / bandwidth, "x_bf16": bf16_us / t,
        })  # fmt: skip
    rows.sort(key=lambda r: r["us"])
    return {
        "batch": batch, "context": context, "bf16_us": bf16_us,
        "bf16_bandwidth_share": bf16_bytes / (bf16_us * 1e-6) / bandwidth, "fp8": rows,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="4096,8192")
    parser.add_argument("--tokens", default="0,32,64,128")
    parser.add_argument("--warps", default="4,8")
    parser.add_argument("--splits", default="0,2,4")
    args = parser.parse_args()
    bandwidth = measure_ceilings(torch.device("cuda"), torch.bfloat16).bandwidth_bytes_per_s
    sweep = list(
        itertools.product(*(map(int, v.split(",")) for v in (args.tokens, args.warps, args.splits)))
    )
    cases = [case(args.batch, int(c), sweep, bandwidth) for c in args.contexts.split(",")]
    for c in cases:
        print(f"batch {c['batch']} context {c['context']}: bf16 {c['bf16_us']:.1f} us "
              f"({c['bf16_bandwidth_share']:.1%})")  # fmt: skip
        for r in c["fp8"][:5]:
            print(f"  fp8 {r}")
    record = {
        "benchmark": "fp8_kv_decode", "commit": git_commit(),
        "device": torch.cuda.get_device_name(), "bandwidth": bandwidth, "cases": cases,
    }  # fmt: skip
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "fp8-kv-decode.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
