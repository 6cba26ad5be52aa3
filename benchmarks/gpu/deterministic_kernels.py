"""Deterministic mode's kernels at real sizes (issue 45; part of benchmarks/gpu/deterministic.sh).

- The batch-invariant matmul on Llama-3-8B's projections and LM head (bf16): rows 1..256 of one
  input, taken as the first m rows and at three other offsets, and inside a 2048-row call,
  must be the bits of the same rows in a 256-row call; its error against a float32 product;
  ``F.linear`` (cuBLAS) counted the same way for contrast; both timed at 1, 64 and 8192 rows.
- The batch-invariant attention on Llama-3-8B's heads (32 query, 8 KV, dim 128): a 3000-token
  prompt in one chunk, in two chunks (the second over its cached prefix, beside another
  sequence's decode row and prompt) and as decode rows alone and batched: the same bits per
  row; the error against torch on some rows; timed beside the default decode and prefill
  kernels.

Prints one JSON object (also to $OUT/deterministic-kernels.json); exit status 1 when a check
fails. ``--device cpu --tiny`` runs tiny sizes under the Triton interpreter (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

LLAMA3_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
TINY = {"one_split": (192, 256), "two_splits": (130, 1000)}


def time_us(fn: Callable[..., Any], *args: Any, iters: int = 20) -> float:
    """Mean µs of one call of fn(*args) on CUDA (events, after warm-up)."""
    for _ in range(3):
        fn(*args)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(*args)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| / (1 + |expected|)."""
    diff = (actual.float() - expected.float()).abs() / (1 + expected.float().abs())
    return float(diff.max())


def check_gemm(
    name: str, n: int, k: int, rows: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    import torch.nn.functional as F

    from splitserve.kernels.invariant_matmul import invariant_matmul, num_splits

    gen = torch.Generator(device=device).manual_seed(n + k)
    weight = (torch.randn(n, k, generator=gen, device=device) / k**0.5).to(dtype)
    big = torch.randn(max(2048, rows + 128), k, generator=gen, device=device).to(dtype)
    x = big[:rows]
    full = invariant_matmul(x, weight)

    def differs(first: int, m: int) -> bool:
        rows_ = slice(first, first + m)
        return not torch.equal(invariant_matmul(x[rows_], weight), full[rows_])

    differ = [m for m in range(1, rows + 1) if differs(0, m)]
    offsets = [o for o in (1, 5, 100) if o < rows]
    shifted = [(o, m) for o in offsets for m in range(1, rows - o + 1) if differs(o, m)]
    in_big = torch.equal(invariant_matmul(big, weight)[:rows], full)
    ref = x.float() @ weight.float().T
    linear_full = F.linear(x, weight)
    linear_differ = sum(
        not torch.equal(F.linear(x[:m], weight), linear_full[:m]) for m in range(1, rows + 1)
    )
    times = {}
    for m in (1, 64, 8192) if device.type == "cuda" else ():
        xm = torch.randn(m, k, device=device).to(dtype)
        times[f"m{m}"] = {
            "invariant_us": time_us(invariant_matmul, xm, weight),
            "f_linear_us": time_us(F.linear, xm, weight),
        }
    return {
        "name": name, "n": n, "k": k, "splits": num_splits(n, k),
        "row_counts_differing": differ, "offset_row_counts_differing": shifted,
        "rows_equal_inside_2048_rows": in_big,
        "ok": not differ and not shifted and in_big,
        "rel_err_vs_float32": rel_err(full, ref),
        "rel_err_f_linear_vs_float32": rel_err(linear_full, ref),
        "f_linear_row_counts_differing": linear_differ, "times": times,
    }  # fmt: skip


def check_attention(
    heads: int, kv_heads: int, dim: int, length: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    from splitserve.kernels.decode_attention import paged_decode_attention_ref
    from splitserve.kernels.invariant_attention import invariant_attention, prefill_tiles

    block = 16
    gen = torch.Generator(device=device).manual_seed(length)
    num_blocks = -(-length // block) + 8
    blocks = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(device)
    table, other = blocks[: -(-length // block)], blocks[-8:]  # a second sequence of 100 tokens
    shape = (num_blocks, block, kv_heads, dim)
    cache = (torch.randn(shape, generator=gen, device=device).to(dtype),
             torch.randn(shape, generator=gen, device=device).to(dtype))  # fmt: skip
    q = torch.randn(length, heads, dim, generator=gen, device=device).to(dtype)
    q_other = torch.randn(100, heads, dim, generator=gen, device=device).to(dtype)
    scale = dim**-0.5
    group = heads // kv_heads

    def attend(
        rows: torch.Tensor, decodes: list[tuple[torch.Tensor, int]],
        chunks: list[tuple[torch.Tensor, int, int]], parallel: bool | None = None,
    ) -> torch.Tensor:  # fmt: skip
        seqs = [t for t, *_ in decodes + chunks]  # type: ignore[misc]
        width = max(t.shape[0] for t in seqs)
        tables = torch.stack([torch.nn.functional.pad(t, (0, width - t.shape[0])) for t in seqs])
        segments, start = [], len(decodes)
        for _, new, context in chunks:
            segments.append((start, new, context))
            start += new
        tiles = prefill_tiles(segments, group, device)
        lens = torch.tensor([c for _, c in decodes], dtype=torch.long, device=device)
        d = len(decodes)
        prompt_tables = tables[d:] if chunks else torch.zeros(0, 1, dtype=torch.long, device=device)
        return invariant_attention(rows, *cache, tables[:d], lens, tiles,
                                   prompt_tables, scale, parallel)  # fmt: skip

    whole = attend(q, [], [(table, length, length)])
    cut = length // 3
    first = attend(q[:cut], [], [(table, cut, cut)])
    mixed = torch.cat([q_other[99:100], q[cut:], q_other[:60]])
    second = attend(mixed, [(other, 100)], [(table, length - cut, length), (other, 60, 60)])
    picks = sorted({p for p in (0, 1, 63, 511, 512, 1023, 1024) if p < length} | {length - 1})
    alone = [
        torch.equal(attend(q[p : p + 1], [(table, p + 1)], [], parallel)[0], whole[p])
        for p in picks
        for parallel in (True, False)  # splits as programs, or in turn
    ]
    batched = attend(q[picks], [(table, p + 1) for p in picks], [])
    in_turn = attend(q[picks], [(table, p + 1) for p in picks], [], False)
    ref = paged_decode_attention_ref(
        q[picks], *cache, table.expand(len(picks), -1),
        torch.tensor(picks, device=device) + 1, scale,
    )  # fmt: skip
    chunked = torch.equal(first, whole[:cut]) and torch.equal(
        second[1 : length - cut + 1], whole[cut:]
    )
    report: dict[str, Any] = {
        "heads": heads, "kv_heads": kv_heads, "dim": dim, "length": length,
        "chunked_equal": chunked, "decode_alone_equal": all(alone),
        "decode_batched_equal": torch.equal(batched, whole[picks])
        and torch.equal(in_turn, whole[picks]),
        "rel_err_vs_float32": rel_err(batched, ref),
    }  # fmt: skip
    report["ok"] = (
        report["chunked_equal"] and report["decode_alone_equal"] and report["decode_batched_equal"]
    )
    if device.type == "cuda":
        report["times"] = attention_times(heads, kv_heads, dim, dtype, device)
    return report


def attention_times(
    heads: int, kv_heads: int, dim: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Decode of 64 and of 1 sequence of 1024 tokens, and one 8192-token prompt: the invariant
    kernel beside the default ones."""
    from splitserve.kernels.decode_attention import paged_decode_attention
    from splitserve.kernels.invariant_attention import invariant_attention, prefill_tiles
    from splitserve.kernels.prefill_attention import paged_prefill_attention

    block, scale = 16, dim**-0.5
    times: dict[str, Any] = {}
    for batch, context in ((1, 1024), (64, 1024), (1, 8192)):
        width = context // block
        cache = torch.randn(2, batch * width, block, kv_heads, dim, device=device).to(dtype)
        tables = torch.arange(batch * width, device=device).view(batch, width)
        lens = torch.full((batch,), context, device=device)
        none = tuple(torch.empty(4, 0, dtype=torch.int32, device=device).unbind(0))
        empty = torch.zeros(0, 1, dtype=torch.long, device=device)
        q = torch.randn(batch, heads, dim, device=device).to(dtype)
        k, v = cache
        times[f"decode_b{batch}_ctx{context}"] = {
            "invariant_us": time_us(invariant_attention, q, k, v, tables, lens, none, empty, scale),
            "default_us": time_us(paged_decode_attention, q, k, v, tables, lens, scale),
        }
    context = 8192
    cache = torch.randn(2, context // block, block, kv_heads, dim, device=device).to(dtype)
    tables = torch.arange(context // block, device=device).view(1, -1)
    q = torch.randn(context, heads, dim, device=device).to(dtype)
    tiles = prefill_tiles([(0, context, context)], heads // kv_heads, device)
    no_tables = torch.zeros(0, 1, dtype=torch.long, device=device)
    no_lens = torch.zeros(0, dtype=torch.long, device=device)
    one = torch.tensor([0], device=device), torch.tensor([context], device=device)
    k, v = cache
    times["prefill_8192"] = {
        "invariant_us": time_us(
            invariant_attention, q, k, v, no_tables, no_lens, tiles, tables, scale, iters=5
        ),
        "default_us": time_us(
            paged_prefill_attention, q, k, v, tables, *one, one[1], context, scale, iters=5
        ),
    }
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes (the CPU smoke test)")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before a kernel module is imported
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shapes, rows = (TINY, 12) if args.tiny else (LLAMA3_8B, 256)
    gemms = [check_gemm(name, n, k, rows, dtype, device) for name, (n, k) in shapes.items()]
    attention = (
        check_attention(8, 2, 32, 150, dtype, device)
        if args.tiny
        else check_attention(32, 8, 128, 3000, dtype, device)
    )
    ok = all(g["ok"] for g in gemms) and attention["ok"]
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "dtype": str(dtype), "commit": os.environ.get("SPLITSERVE_GIT_COMMIT"),
        "ok": ok, "gemms": gemms, "attention": attention,
    }  # fmt: skip
    text = json.dumps(report, indent=1)
    print(text)
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "deterministic-kernels.json").write_text(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
