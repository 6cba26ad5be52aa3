"""The native block products on Gemma 3 270M's Q4_K_M tensors, per byte against Q4_1.

Each of the engine's projection shapes is taken from the embedded file (``gemma3-270m``) in its
own type (Q5_0, Q4_K, Q6_K, Q8_0; the q|k|v of the layers whose v is Q8_0 widened to Q8_0, as
the engine keeps it) and again as Q4_1 (gguf's quantizer on the same dequantized weights, the
type whose path the K-quants are held to). Each (shape, type, rows) times every ISA the CPU
runs, best of --repeats runs of --calls calls; the small weights stay in cache (the kernel, not
memory bandwidth), the 178 MB LM head streams from memory. GB/s is the weight's bytes over the
time; "vs Q4_1" is that rate over Q4_1's on the same shape, rows and ISA. Threads are torch's
(OMP_NUM_THREADS=1 for one). Prints a table and writes JSON.

OMP_NUM_THREADS=1 python -m benchmarks.kernels.native_kquants --output native_kquants.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from benchmarks.kernels.native_blocks import time_us
from splitserve.bench.report import git_commit
from splitserve.engine.gguf_file import read_gguf
from splitserve.engine.loader import resolve_model
from splitserve.kernels.native.blocks import (
    ISAS,
    NAMES,
    Q4_1,
    Q8_0,
    best_isa,
    in_features,
    to_q8_0,
)


def gemma_shapes() -> list[tuple[str, torch.Tensor, int]]:
    """(name, blocks [N, ...], type) of each projection kind, from the first layer that holds
    it in that type."""
    tensors = {t.name: t for t in read_gguf(resolve_model("gemma3-270m")).tensors}

    def blocks(name: str) -> tuple[torch.Tensor, int]:
        t = tensors[name]
        return torch.from_numpy(np.array(t.data)), int(t.tensor_type)

    def layer(part: str, qtype: int) -> int:
        return next(i for i in range(18) if blocks(f"blk.{i}.{part}.weight")[1] == qtype)

    out = []
    for v_type in sorted({blocks(f"blk.{i}.attn_v.weight")[1] for i in range(18)}):
        i = layer("attn_v", v_type)
        parts = [blocks(f"blk.{i}.attn_{p}.weight") for p in "qkv"]
        if v_type == Q8_0:
            parts = [(b, q) if q == Q8_0 else (to_q8_0(b, q), Q8_0) for b, q in parts]
        out.append(("q|k|v", torch.cat([b for b, _ in parts]), parts[0][1]))
    out.append(("o", *blocks("blk.0.attn_output.weight")))
    gate, qtype = blocks("blk.0.ffn_gate.weight")
    out.append(("gate|up", torch.cat((gate, blocks("blk.0.ffn_up.weight")[0])), qtype))
    for down_type in sorted({blocks(f"blk.{i}.ffn_down.weight")[1] for i in range(18)}):
        out.append(("down", *blocks(f"blk.{layer('ffn_down', down_type)}.ffn_down.weight")))
    out.append(("lm_head", *blocks("token_embd.weight")))
    return out


def as_q4_1(blocks: torch.Tensor, qtype: int) -> torch.Tensor:
    weights = dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    return torch.from_numpy(quantize(weights, GGMLQuantizationType.Q4_1).copy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    isas = [name for name in ISAS[1:] if ISAS.index(name) <= best_isa()]
    results = []
    for name, blocks, qtype in gemma_shapes():
        q4_1 = as_q4_1(blocks, qtype)
        n, k = blocks.shape[0], in_features(qtype, blocks)
        calls = max(1, args.calls * 4096 // max(n, 4096))
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            for isa in isas:
                us = time_us(x, blocks, qtype, isa, None, calls, args.repeats)
                base = time_us(x, q4_1, Q4_1, isa, None, calls, args.repeats)
                rate, base_rate = blocks.numel() / us / 1e3, q4_1.numel() / base / 1e3
                results.append({"shape": name, "N": n, "K": k, "type": NAMES[qtype],
                                "rows": rows, "isa": isa, "us": us, "gb_per_s": rate,
                                "q4_1_us": base, "q4_1_gb_per_s": base_rate,
                                "per_byte_vs_q4_1": rate / base_rate})  # fmt: skip
    print(f"{'shape':8} {'N x K':>12} {'type':5} {'rows':>4} {'isa':7} {'us':>9} {'GB/s':>6} "
          f"{'Q4_1 us':>9} {'GB/s':>6}  vs Q4_1")  # fmt: skip
    for r in results:
        print(f"{r['shape']:8} {r['N']:>6}x{r['K']:<5} {r['type']:5} {r['rows']:>4} {r['isa']:7} "
              f"{r['us']:9.1f} {r['gb_per_s']:6.2f} {r['q4_1_us']:9.1f} {r['q4_1_gb_per_s']:6.2f}"
              f"  {r['per_byte_vs_q4_1']:.2f}x")  # fmt: skip
    config = {"threads": torch.get_num_threads(), "calls": args.calls, "repeats": args.repeats}
    report = {"benchmark": "native_kquants", "commit": git_commit(),
              "config": {**config, "isas": isas}, "results": results}  # fmt: skip
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
