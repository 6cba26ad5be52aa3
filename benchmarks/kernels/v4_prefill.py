"""DeepSeek-V4's prefill attention: the blocked path (``layers/v4_prefill.py:
prefill_attention``) against one masked score matrix over the chunk (``prefill_reference``,
the engine's path before it), one layer's chunk of ``--tokens`` queries from position 0, per
compressed kind (V4-Flash: 64 heads of 512, window 128; CSA entries of 4 tokens, the
indexer's best 512 by 64 heads of 128; HCA entries of 128 tokens).

    python -m benchmarks.kernels.v4_prefill                  # CUDA, bfloat16, 8k tokens
    python -m benchmarks.kernels.v4_prefill --device cpu --reduced --tokens 2048

``--reduced``: 8 heads of 128 and 8 index heads of 64 (window, rates and top-k as V4-Flash's),
float32: a size the CPU times in seconds. On CUDA, for HCA, also the decode kernel with each
row a decode row over its own context (``layers/v4_decode.py: prefill_kernels``, the "triton"
backend's prefill of a layer without an indexer), over the same keys and entries in paged
caches. Prints a table: ms of
each path, the largest error of each against the reference (relative to its largest value),
for CSA the share of the blocked path's picks that the reference chose too (bfloat16 scores
may swap near-ties at the k-th), and the useful attention FLOPs (each row's window and chosen
entries) a second of the fastest path.
JSON to $OUT/v4-prefill.json when OUT is set. ``--score-mib 256,1024`` runs the blocked
path (and the kernel) at each budget of a pass's temporaries (``v4_decode.SCORE_BYTES``): at 8k
rows, 256 MiB gives CSA 32 passes of two 128-row blocks (1,052 torch ops on the meta device),
1,024 MiB 6 passes (214 ops).
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

from splitserve.engine.layers import v4_decode
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


def paged(
    keys: torch.Tensor, entries: Entries, block: int = 64
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], Any]:
    """The same keys and HCA entries in paged caches as the engine keeps them, for the
    kernel: the key cache [blocks, block, dim] with each row's table and length (its position
    + 1), group 0's entry pieces (an entry in ``rate`` slots) likewise."""
    tokens = keys.shape[0]
    dev = keys.device

    def cache(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        pad = -rows.shape[0] % block
        blocks = torch.cat([rows, rows.new_zeros(pad, rows.shape[1])]).view(
            -1, block, rows.shape[1]
        )
        return blocks, torch.arange(blocks.shape[0], device=dev).expand(tokens, -1)

    key_cache, key_tables = cache(keys)
    lens = torch.arange(1, tokens + 1, device=dev)
    entry_cache, tables = cache(entries.keys.reshape(entries.keys.shape[0] * entries.rate, -1))
    return key_cache, (key_tables, lens), (entry_cache, tables, lens, entries.rate)


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


def measure(
    shape: Shape, kind: str, tokens: int, dev: torch.device, reference: bool, profile: bool
) -> dict[str, Any]:
    """Both paths (on CUDA also the kernels: ``v4_decode.prefill_kernels``) on one chunk."""
    dtype = torch.float32 if shape is REDUCED else torch.bfloat16
    q, keys, sinks, entries = inputs(shape, kind, tokens, dtype, dev)
    args = (q, keys, 0, sinks, shape.window, entries)
    paths = {"blocked": lambda: prefill_attention(*args)}
    if dev.type == "cuda" and entries.indexer is None:  # the engine's CSA stays in torch
        from splitserve.engine.layers.v4_decode import prefill_kernels  # lazy: Triton

        key_cache, tables, paged_entries = paged(keys, entries)
        run = (q, key_cache, tables, sinks, shape.window, paged_entries)
        paths["kernels"] = lambda: prefill_kernels(*run)
    iters = 5 if dev.type == "cuda" else 1
    result: dict[str, Any] = {"kind": kind, "tokens": tokens, "dtype": str(dtype)[6:]}
    for name, fn in paths.items():
        result[f"{name}_ms"] = time_ms(fn, dev, iters)
    flops = useful_flops(shape, kind, tokens)
    result["useful_tflops"] = flops / min(result[f"{name}_ms"] for name in paths) / 1e9
    if reference:
        result["reference_ms"] = time_ms(lambda: prefill_reference(*args), dev, 1)
        want = prefill_reference(*args).float()
        for name, fn in paths.items():
            result[f"{name}_rel_err"] = float((fn().float() - want).abs().max() / want.abs().max())
    if kind == "csa":
        result["choice_agreement"] = choice_agreement(entries, tokens)
    if profile:
        for name, fn in paths.items():
            print_kernels(fn, f"{kind}, {name}")
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
    parser.add_argument(
        "--score-mib",
        default=str(v4_decode.SCORE_BYTES >> 20),
        help="v4_decode.SCORE_BYTES values to run at, in MiB (comma-separated; the reference "
        "at the first): the size of the passes",
    )
    args = parser.parse_args()
    dev = torch.device(args.device)
    shape = REDUCED if args.reduced else FLASH
    rows = []
    for i, mib in enumerate(map(int, args.score_mib.split(","))):
        v4_decode.SCORE_BYTES = mib << 20
        for kind in args.kinds.split(","):
            reference = not args.no_reference and i == 0
            rows.append({"score_mib": mib, **measure(shape, kind, args.tokens, dev, reference,
                                                      args.profile)})  # fmt: skip
    nan = float("nan")
    head = ("reference ms", "blocked ms", "rel err", "kernels ms", "rel err", "picks agree")
    print(f"{'kind':<5} {'tokens':>6} {'MiB':>5} " + " ".join(f"{h:>12}" for h in head), end=" ")
    print("TFLOP/s useful")
    for r in rows:
        keys = ("reference_ms", "blocked_ms", "blocked_rel_err", "kernels_ms", "kernels_rel_err")
        cells = [f"{r.get(k, nan):>12.2f}" for k in keys]
        cells[2], cells[4] = f"{r.get(keys[2], nan):>12.1e}", f"{r.get(keys[4], nan):>12.1e}"
        cells.append(f"{r.get('choice_agreement', nan):>12.4f}")
        first = f"{r['kind']:<5} {r['tokens']:>6} {r['score_mib']:>5} "
        print(first + " ".join(cells), f"{r['useful_tflops']:.2f}")
    if os.environ.get("OUT"):
        result = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                  "shape": shape.__dict__, "rows": rows}  # fmt: skip
        Path(os.environ["OUT"], "v4-prefill.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
