"""DeepSeek-V4's prefill attention: the blocked path (``layers/v4_prefill.py:
prefill_attention``) against one masked score matrix over the chunk (``prefill_reference``,
the engine's path before it), one layer's chunk of ``--tokens`` queries from position 0, per
compressed kind (V4-Flash: 64 heads of 512, window 128; CSA entries of 4 tokens, the
indexer's best 512 by 64 heads of 128; HCA entries of 128 tokens).

    python -m benchmarks.kernels.v4_prefill                  # CUDA, bfloat16, 8k tokens
    python -m benchmarks.kernels.v4_prefill --device cpu --reduced --tokens 2048

``--reduced``: 8 heads of 128 and 8 index heads of 64 (window, rates and top-k as V4-Flash's),
float32: a size the CPU times in seconds. Prints a table: ms of each path, the speedup, the
largest error against the reference (relative to its largest value), for CSA the share of
the blocked path's picks that the reference chose too (bfloat16 scores may swap near-ties
at the k-th), and the useful attention FLOPs (each row's window and chosen entries) a second.
JSON to $OUT/v4-prefill.json when OUT is set.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity

from splitserve.engine.layers.lightning_indexer import choose, index_scores
from splitserve.engine.layers.v4_prefill import (
    Entries,
    Indexer,
    pick,
    prefill_attention,
    prefill_reference,
)


@dataclass(frozen=True)
class Shape:
    heads: int
    dim: int
    window: int
    rates: dict[str, int]
    topk: int
    index_heads: int
    index_dim: int


FLASH = Shape(64, 512, 128, {"csa": 4, "hca": 128}, 512, 64, 128)
REDUCED = Shape(8, 128, 128, {"csa": 4, "hca": 128}, 512, 8, 64)


def inputs(shape: Shape, kind: str, tokens: int, dtype: torch.dtype, dev: torch.device) -> Any:
    """Queries and keys of unit RMS (as after their norms), entries, index inputs, sinks."""
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*size: int) -> torch.Tensor:
        return torch.randn(*size, generator=g, device=dev).to(dtype)

    q, keys = randn(tokens, shape.heads, shape.dim), randn(tokens, shape.dim)
    rate = shape.rates[kind]
    count = tokens // rate
    indexer = None
    if kind == "csa":
        weights = randn(tokens, shape.index_heads).float() * shape.index_heads**-0.5
        index_q = randn(tokens, shape.index_heads, shape.index_dim)
        indexer = Indexer(index_q, weights, randn(count, shape.index_dim), shape.topk)
    sinks = torch.randn(shape.heads, generator=g, device=dev)
    return q, keys, sinks, Entries(randn(count, shape.dim), rate, indexer)


def time_ms(fn: Any, dev: torch.device, iters: int) -> float:
    fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    begin = time.perf_counter()
    for _ in range(iters):
        fn()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - begin) / iters * 1e3


def useful_flops(shape: Shape, kind: str, tokens: int) -> float:
    """QK and PV over each row's window and the entries it attends to."""
    rows = torch.arange(tokens, dtype=torch.float64)
    seen = (rows + 1) // shape.rates[kind]
    far = seen.clamp(max=shape.topk) if kind == "csa" else seen
    keys = (rows + 1).clamp(max=shape.window) + far
    return float(4 * shape.heads * shape.dim * keys.sum())


def choice_agreement(entries: Entries, tokens: int) -> float:
    """The share of the blocked path's picks (all rows') that ``choose`` makes too, in passes
    of 1,024 rows."""
    index = entries.indexer
    assert index is not None
    count, agreed, total = entries.keys.shape[0], 0, 0
    for first in range(0, tokens, 1024):
        last = min(tokens, first + 1024)
        rows = torch.arange(first, last, device=index.q.device)
        seen = (rows + 1) // entries.rate
        picks = pick(index, first, last, count, seen[:, None])
        scores = index_scores(index.q[first:last], index.weights[first:last], index.keys)
        chosen = choose(scores, seen, index.topk)
        valid = picks >= 0
        agreed += int(chosen.gather(1, picks.clamp(min=0))[valid].sum())
        total += int(valid.sum())
    return agreed / max(total, 1)


def measure(shape: Shape, kind: str, tokens: int, dtype: torch.dtype, dev: torch.device,
            reference: bool, profile: bool = False) -> dict[str, Any]:  # fmt: skip
    q, keys, sinks, entries = inputs(shape, kind, tokens, dtype, dev)
    args = (q, keys, 0, sinks, shape.window, entries)
    iters = 5 if dev.type == "cuda" else 1
    result: dict[str, Any] = {"kind": kind, "tokens": tokens, "dtype": str(dtype)[6:]}
    result["blocked_ms"] = time_ms(lambda: prefill_attention(*args), dev, iters)
    result["useful_tflops"] = useful_flops(shape, kind, tokens) / result["blocked_ms"] / 1e9
    if reference:
        result["reference_ms"] = time_ms(lambda: prefill_reference(*args), dev, 1)
        result["speedup"] = result["reference_ms"] / result["blocked_ms"]
        want = prefill_reference(*args).float()
        err = (prefill_attention(*args).float() - want).abs().max() / want.abs().max()
        result["rel_err"] = float(err)
    if kind == "csa":
        result["choice_agreement"] = choice_agreement(entries, tokens)
    if profile:
        print_kernels(lambda: prefill_attention(*args), kind)
    return result


def print_kernels(fn: Any, kind: str) -> None:
    """The blocked path's 12 costliest ops (the device's time where it has one)."""
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        fn()
        torch.cuda.synchronize() if torch.cuda.is_available() else None
    key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(f"== {kind}")
    print(prof.key_averages().table(sort_by=key, row_limit=12, max_name_column_width=60))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--kinds", default="hca,csa")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--reduced", action="store_true", help="8 heads of 128, float32")
    parser.add_argument("--no-reference", action="store_true", help="time the blocked path only")
    parser.add_argument("--profile", action="store_true", help="the blocked path's top ops")
    args = parser.parse_args()
    dev = torch.device(args.device)
    shape = REDUCED if args.reduced else FLASH
    dtype = torch.float32 if args.reduced else torch.bfloat16
    rows = [
        measure(shape, kind, args.tokens, dtype, dev, not args.no_reference, args.profile)
        for kind in args.kinds.split(",")
    ]
    print(f"{'kind':<5} {'tokens':>6} {'blocked ms':>10} {'reference ms':>12} {'speedup':>8} "
          f"{'rel err':>8} {'picks agree':>11} {'useful TFLOP/s':>14}")  # fmt: skip
    for r in rows:
        cells = [r.get(k, float("nan")) for k in ("reference_ms", "speedup", "rel_err")]
        print(
            f"{r['kind']:<5} {r['tokens']:>6} {r['blocked_ms']:>10.2f} {cells[0]:>12.2f} "
            f"{cells[1]:>8.1f} {cells[2]:>8.1e} {r.get('choice_agreement', float('nan')):>11.4f} "
            f"{r['useful_tflops']:>14.2f}"
        )
    if os.environ.get("OUT"):
        result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                  "shape": shape.__dict__, "rows": rows}  # fmt: skip
        Path(os.environ["OUT"], "v4-prefill.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
