"""DeepSeek-V4's decode kernels against their torch references, then timed, on one GPU
(V4-Flash's attention: 64 heads of 512, window 128, CSA entries of 4 tokens with the
indexer's best 512 by 64 heads of 128, HCA entries of 128 tokens; bfloat16, blocks of 16).

    python3 -m benchmarks.kernels.v4_decode --batches 1,64,256 --contexts 4096,16384,65536,131072

Per (layer kind, batch, context) one JSON line: the largest error of the attention kernel
against ``layers/v4_decode.py: decode_reference`` (on the first 4 rows, both given the
kernels' index list), for CSA the indexer's largest score error against the torch path's
``index_scores`` and the share of its choice that ``choose`` makes too (bfloat16 scores may
tie or swap at the k-th), then the time in µs of the kernels (CSA: scores, choice and
attention) and of the reference (the engine's torch path, a row at a time; up to batch 64),
and the kernels' share of the bandwidth bound (``read_bytes`` at 4.24 TB/s, the H200's
measured copy bandwidth, docs/performance.md).
Every row is ``context`` tokens long; group 0's rows are as wide as V4-Flash's (3,292
values), its blocks drawn from a pool of at most 8 GB (rows then share blocks). Written to
$OUT/v4-decode.json when OUT is set, after each case (a run cut short keeps what it did);
exits 1 when a check fails. ``--smoke`` runs the tiny test shape on the CPU (with
TRITON_INTERPRET=1) to check the script itself.
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

from splitserve.engine.layers.lightning_indexer import choose
from splitserve.engine.layers.lightning_indexer import index_scores as torch_scores
from splitserve.engine.layers.v4_decode import decode_reference, held_entries
from splitserve.kernels.v4_decode import v4_decode_attention
from splitserve.kernels.v4_indexer import index_scores, select_topk


@dataclass(frozen=True)
class Shape:
    heads: int
    dim: int
    window: int
    rates: dict[str, int]
    topk: int
    index_heads: int
    index_dim: int
    block: int
    row: int
    """Values a token in group 0 (every compressed layer's pieces)."""
    dtype: torch.dtype
    tol: float


FLASH = Shape(64, 512, 128, {"csa": 4, "hca": 128}, 512, 64, 128, 16, 3292, torch.bfloat16, 3e-2)
TINY = Shape(4, 32, 8, {"csa": 4, "hca": 8}, 3, 16, 16, 4, 64, torch.float32, 1e-4)
POOL_BYTES = 8e9
Entries = tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]


def time_us(fn: Any, device: torch.device, iters: int) -> float:
    fn()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - start) * 1e6 / iters


def case(
    shape: Shape, kind: str, batch: int, context: int, dev: torch.device
) -> tuple[list[torch.Tensor], Entries | None]:
    """The kernels' arguments for ``batch`` rows of ``context`` tokens: [q, key cache, key
    tables, key lens, sinks] and the entries (None in a sliding layer)."""
    block, dim, dtype = shape.block, shape.dim, shape.dtype
    first = max(context - shape.window, 0) // block
    key_len = context - first * block
    key_blocks = -(-key_len // block)
    keys = torch.randn(batch * key_blocks, block, dim, device=dev).to(dtype)
    key_tables = torch.randperm(batch * key_blocks, device=dev).view(batch, key_blocks)
    key_lens = torch.full((batch,), key_len, device=dev)
    q = torch.randn(batch, shape.heads, dim, device=dev).to(dtype)
    sinks = torch.randn(shape.heads, device=dev)
    window = [q, keys, key_tables, key_lens, sinks]
    if kind == "sliding":
        return window, None
    rate = shape.rates[kind]
    piece = (dim + (shape.index_dim if kind == "csa" else 0)) // rate
    width = -(-context // block)
    bytes_a_block = block * shape.row * torch.finfo(dtype).bits // 8
    pool = max(width, min(batch * width, int(POOL_BYTES // bytes_a_block)))
    group0 = torch.randn(pool, block, 1, shape.row, device=dev).to(dtype)
    tables = torch.stack([torch.randperm(pool, device=dev)[:width] for _ in range(batch)])
    lens = torch.full((batch,), context, device=dev)
    return window, (group0[:, :, 0, 7 : 7 + piece], tables, lens, rate)


def read_bytes(shape: Shape, kind: str, batch: int, context: int) -> int:
    """What the kernels must read at least: the window's keys, the entries attended (CSA:
    the best topk) and the index keys scored, in the cache's dtype."""
    values = min(context, shape.window) * shape.dim
    if kind != "sliding":
        count = context // shape.rates[kind]
        values += min(count, shape.topk if kind == "csa" else count) * shape.dim
        values += count * shape.index_dim if kind == "csa" else 0
    return batch * values * torch.finfo(shape.dtype).bits // 8


def measure(shape: Shape, kind: str, batch: int, context: int, dev: torch.device) -> dict[str, Any]:
    (q, keys, key_tables, key_lens, sinks), entries = case(shape, kind, batch, context, dev)
    window, dim, result = shape.window, shape.dim, {}
    index_q = torch.randn(batch, shape.index_heads, shape.index_dim, device=dev).to(shape.dtype)
    weights = torch.randn(batch, shape.index_heads, device=dev) * shape.index_heads**-0.5

    def kernels() -> tuple[torch.Tensor, torch.Tensor | None]:
        index = None
        if kind == "csa" and entries is not None:
            index = select_topk(index_scores(index_q, weights, entries, dim), shape.topk)
        args = (q, keys, key_tables, key_lens, sinks, window, entries, index)
        return v4_decode_attention(*args), index

    out, index = kernels()
    rows = min(batch, 4)
    first = None
    if entries is not None:
        first = (entries[0], entries[1][:rows], entries[2][:rows], entries[3])
    chosen = None if index is None else index[:rows]
    args = (q[:rows], keys, key_tables[:rows], key_lens[:rows], sinks, window, first, chosen)
    expected = decode_reference(*args)
    result["err"] = (out[:rows].float() - expected.float()).abs().max().item()
    if index is not None and entries is not None:
        scores = index_scores(index_q, weights, entries, dim)
        count = context // entries[3]
        keys0 = held_entries(entries[0], entries[1][0], count, entries[3])[:, dim:]
        ref = torch_scores(index_q[:1], weights[:1], keys0)[0]
        result["score_err"] = (scores[0, :count] - ref).abs().max().item()
        torch_choice = choose(ref[None], torch.tensor([count], device=dev), shape.topk)[0]
        picked = index[0][index[0] >= 0]
        result["choice_agreement"] = torch_choice[picked].float().mean().item()
    iters = 20 if dev.type == "cuda" else 1
    result["kernel_us"] = time_us(kernels, dev, iters)
    result["bandwidth_share"] = (
        read_bytes(shape, kind, batch, context) / result["kernel_us"] / 4.24e6
    )
    if batch <= 64:
        args = (q, keys, key_tables, key_lens, sinks, window, entries, index)
        result["reference_us"] = time_us(lambda: decode_reference(*args), dev, max(1, iters // 10))
    result["ok"] = result["err"] <= shape.tol
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--contexts", default="4096,16384,65536,131072")
    parser.add_argument("--kinds", default="sliding,csa,hca")
    parser.add_argument("--smoke", action="store_true", help="the tiny shape on the CPU")
    args = parser.parse_args()
    shape = TINY if args.smoke else FLASH
    dev = torch.device("cpu" if args.smoke else "cuda")
    torch.manual_seed(0)
    lines, ok = [], True
    for kind in args.kinds.split(","):
        for batch in map(int, args.batches.split(",")):
            for context in map(int, args.contexts.split(",")):
                line = {"kind": kind, "batch": batch, "context": context}
                line.update(measure(shape, kind, batch, context, dev))
                ok &= line["ok"]
                print(json.dumps(line), flush=True)
                lines.append(line)
                if os.environ.get("OUT"):  # after each case: a run cut short keeps its lines
                    Path(os.environ["OUT"], "v4-decode.json").write_text(
                        json.dumps(lines, indent=1)
                    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
