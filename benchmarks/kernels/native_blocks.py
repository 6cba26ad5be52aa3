"""The native block products (kernels/native/blocks.c) on SmolLM2-135M's shapes, per instruction
set, in one process: random weights in the model's GGUF types, 1 and 32 rows of x.

Each (shape, rows) times every ISA the CPU runs in turn, best of --repeats runs of --calls
calls each (the weights stay in cache: this is the kernel, not memory bandwidth). Threads are
torch's: run with OMP_NUM_THREADS=1 for one thread. Prints a table and writes JSON.

OMP_NUM_THREADS=1 python -m benchmarks.kernels.native_blocks --output native_blocks.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize

from splitserve.bench.report import git_commit
from splitserve.kernels.native.blocks import (
    ISAS,
    NAMES,
    Q4_1,
    Q8_0,
    best_isa,
    block_matmul,
    interleave,
)

# SmolLM2-135M-Instruct.Q4_1.gguf: name, outputs N, inputs K, type (the LM head is the tied
# Q8_0 token embedding).
SHAPES = (
    ("q|k|v", 960, 576, Q4_1),
    ("o", 576, 576, Q4_1),
    ("gate|up", 3072, 576, Q4_1),
    ("down", 576, 1536, Q4_1),
    ("lm_head", 49152, 576, Q8_0),
)
INTERLEAVED = "interleaved"
GGML = {Q4_1: GGMLQuantizationType.Q4_1, Q8_0: GGMLQuantizationType.Q8_0}


def weights(n: int, k: int, qtype: int) -> torch.Tensor:
    w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(quantize(w, GGML[qtype]).copy())


def product(
    x: torch.Tensor, blocks: torch.Tensor, qtype: int, kernel: str, il: torch.Tensor | None
) -> torch.Tensor:
    """kernel: an ISA on the GGUF rows, or "interleaved" (AVX-512 on the interleaved copy)."""
    if kernel == INTERLEAVED:
        return block_matmul(x, blocks, qtype, "avx512", interleaved=il)
    return block_matmul(x, blocks, qtype, kernel)


def time_us(
    x: torch.Tensor,
    blocks: torch.Tensor,
    qtype: int,
    kernel: str,
    il: torch.Tensor | None,
    calls: int,
    repeats: int,
) -> float:
    product(x, blocks, qtype, kernel, il)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            product(x, blocks, qtype, kernel, il)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def table_row(r: dict, isas: list[str]) -> str:
    times = " ".join(f"{r['us'][isa]:10.1f}" for isa in isas)
    gain = r["us"][isas[0]] / min(r["us"].values())
    shape = f"{r['shape']:8} {r['N']:>5}x{r['K']:<5} {r['type']:5} {r['rows']:>4}"
    return f"{shape} {times}  {gain:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,32")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    isas = [name for name in ISAS[1:] if ISAS.index(name) <= best_isa()]
    if isas[-1] == "avx512":
        isas.append(INTERLEAVED)
    results = []
    for name, n, k, qtype in SHAPES:
        blocks = weights(n, k, qtype)
        il = interleave(blocks, qtype)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
            outs = {isa: product(x, blocks, qtype, isa, il) for isa in isas}
            spread = max(float((o - outs[isas[0]]).abs().max()) for o in outs.values())
            us = {isa: time_us(x, blocks, qtype, isa, il, args.calls, args.repeats) for isa in isas}
            results.append({"shape": name, "N": n, "K": k, "type": NAMES[qtype], "rows": rows,
                            "us": us, "max_abs_diff": spread})  # fmt: skip
    header = f"{'shape':8} {'N x K':>11} {'type':5} {'rows':>4} " + " ".join(
        f"{isa + ' us':>10}" for isa in isas
    )
    print(header + "  speedup")
    for r in results:
        print(table_row(r, isas))
    config = {"threads": torch.get_num_threads(), "calls": args.calls, "repeats": args.repeats}
    report = {
        "benchmark": "native_blocks",
        "commit": git_commit(),
        "config": {**config, "isas": isas},
        "results": results,
    }
    if args.output:
        args.output.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
