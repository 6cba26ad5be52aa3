"""Checks every Triton kernel against its torch reference on CUDA, then times it.

Run on the GPU machine from the repository root (needs only torch and triton):

    python3 -m benchmarks.kernels.triton_kernels

Prints one row per (kernel, dtype): the largest error against the reference (absolute below
magnitude 1, relative above; bfloat16's unit in the last place is 2^-8 relative), the
kernel's time in µs beside the torch baseline's, and GB/s (decode attention: KV bytes read;
elementwise kernels: bytes read + written) or TFLOP/s (prefill attention). Writes the rows as
JSON to $OUT/kernels.json when OUT is set. Exits 1 when any check fails.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]

from splitserve.engine.layers.attention import TorchAttention  # noqa: E402
from splitserve.kernels import (  # noqa: E402
    activation,
    decode_attention,
    kv_write,
    prefill_attention,
    rmsnorm,
    rotary,
)

# Llama-3-8B shapes.
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER = 32, 8, 128, 4096, 14336
BLOCK_SIZE = 16
TOL = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}
DEV = torch.device("cuda")


def time_us(fn: Callable[[], Any], iters: int = 50) -> float:
    """Mean time of one call in µs (CUDA events, after warm-up)."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / iters


def max_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest |actual - expected| / (1 + |expected|): absolute near 0, relative above 1."""
    expected = expected.float()
    return ((actual.float() - expected).abs() / (1 + expected.abs())).max().item()


def paged_kv(contexts: list[int], dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Random caches holding the contexts in shuffled blocks, their tables and lengths."""
    counts = [-(-c // BLOCK_SIZE) for c in contexts]
    num_blocks = sum(counts) + 1
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, dtype=dtype, device=DEV)
    v_cache = torch.randn(shape, dtype=dtype, device=DEV)
    ids = torch.randperm(num_blocks, device=DEV)
    tables = torch.zeros(len(contexts), max(counts), dtype=torch.long, device=DEV)
    used = 0
    for row, count in enumerate(counts):
        tables[row, :count] = ids[used : used + count]
        used += count
    lens = torch.tensor(contexts, device=DEV)
    return k_cache, v_cache, tables, lens


def row(name: str, dtype: torch.dtype, shape: str, err: float, tol: float, us: float,
        base_us: float | None = None, gbps: float | None = None,
        tflops: float | None = None) -> dict[str, Any]:  # fmt: skip
    return {
        "kernel": name, "dtype": str(dtype).removeprefix("torch."), "shape": shape,
        "max_err": err, "tol": tol, "ok": err <= tol, "us": us, "torch_us": base_us,
        "gbps": gbps, "tflops": tflops,
    }  # fmt: skip


def bench_decode(dtype: torch.dtype, batch: int, context: int) -> dict[str, Any]:
    k_cache, v_cache, tables, lens = paged_kv([context] * batch, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=DEV)
    scale = HEAD_DIM**-0.5
    args = (q, k_cache, v_cache, tables, lens, scale)
    err = max_err(
        decode_attention.paged_decode_attention(*args),
        decode_attention.paged_decode_attention_ref(*args),
    )
    us = time_us(lambda: decode_attention.paged_decode_attention(*args))
    meta = _decode_meta(tables, lens)
    torch_backend = TorchAttention(HEADS, KV_HEADS, HEAD_DIM)
    base = time_us(lambda: torch_backend._decode(q, k_cache, v_cache, meta))
    kv_bytes = 2 * batch * context * KV_HEADS * HEAD_DIM * q.element_size()
    shape = f"B={batch} ctx={context} H={HEADS}/{KV_HEADS} D={HEAD_DIM}"
    return row("decode_attention", dtype, shape, err, TOL[dtype], us, base, kv_bytes / us / 1e3)


def _decode_meta(tables: torch.Tensor, lens: torch.Tensor) -> Any:
    from splitserve.engine.layers.attention import AttentionMetadata

    empty = torch.empty(0, dtype=torch.long, device=DEV)
    return AttentionMetadata(empty, len(lens), tables, lens, [])


def bench_prefill(dtype: torch.dtype, seqs: int, new: int, cached: int) -> dict[str, Any]:
    k_cache, v_cache, tables, lens = paged_kv([cached + new] * seqs, dtype)
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, dtype=dtype, device=DEV)
    starts = torch.arange(seqs, device=DEV) * new
    q_lens = torch.full((seqs,), new, device=DEV)
    args = (q, k_cache, v_cache, tables, starts, q_lens, lens)
    scale = HEAD_DIM**-0.5
    out = prefill_attention.paged_prefill_attention(*args, new, scale)
    err = max_err(out, prefill_attention.paged_prefill_attention_ref(*args, scale))
    us = time_us(lambda: prefill_attention.paged_prefill_attention(*args, new, scale), 20)
    pairs = seqs * (new * cached + new * (new + 1) // 2)
    flops = 4 * HEADS * HEAD_DIM * pairs
    shape = f"S={seqs} new={new} cached={cached} H={HEADS}/{KV_HEADS} D={HEAD_DIM}"
    return row("prefill_attention", dtype, shape, err, TOL[dtype], us, tflops=flops / us / 1e6)


def bench_elementwise(dtype: torch.dtype, tokens: int) -> list[dict[str, Any]]:
    size = torch.empty((), dtype=dtype).element_size()
    rows = []
    x = torch.randn(tokens, HIDDEN, dtype=dtype, device=DEV)
    res = torch.randn_like(x)
    w = torch.randn(HIDDEN, dtype=dtype, device=DEV)
    out, new_res = rmsnorm.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_res = rmsnorm.fused_add_rms_norm_ref(x, res, w, 1e-5)
    err = max(max_err(out, ref_out), 0.0 if torch.equal(new_res, ref_res) else float("inf"))
    us = time_us(lambda: rmsnorm.fused_add_rms_norm(x, res, w, 1e-5))
    base = time_us(lambda: rmsnorm.fused_add_rms_norm_ref(x, res, w, 1e-5))
    gbps = 4 * x.numel() * size / us / 1e3
    rows.append(row("fused_add_rms_norm", dtype, f"T={tokens} hidden={HIDDEN}", err,
                    TOL[dtype], us, base, gbps))  # fmt: skip

    gate_up = torch.randn(tokens, 2 * INTER, dtype=dtype, device=DEV)
    err = max_err(activation.silu_and_mul(gate_up), activation.silu_and_mul_ref(gate_up))
    us = time_us(lambda: activation.silu_and_mul(gate_up))
    base = time_us(lambda: activation.silu_and_mul_ref(gate_up))
    gbps = 3 * tokens * INTER * size / us / 1e3
    rows.append(row("silu_and_mul", dtype, f"T={tokens} inter={INTER}", err, TOL[dtype], us,
                    base, gbps))  # fmt: skip

    qkv = torch.randn(tokens, (HEADS + 2 * KV_HEADS) * HEAD_DIM, dtype=dtype, device=DEV)
    q = qkv[:, : HEADS * HEAD_DIM].view(tokens, HEADS, HEAD_DIM)
    k = qkv[:, HEADS * HEAD_DIM : (HEADS + KV_HEADS) * HEAD_DIM].view(tokens, KV_HEADS, HEAD_DIM)
    v = qkv[:, (HEADS + KV_HEADS) * HEAD_DIM :].view(tokens, KV_HEADS, HEAD_DIM)
    positions = torch.randint(0, 8192, (tokens,), device=DEV)
    freqs = torch.arange(8192, device=DEV)[:, None] * (
        500000.0 ** -(torch.arange(0, HEAD_DIM, 2, device=DEV) / HEAD_DIM)
    )
    emb = torch.cat((freqs, freqs), -1)
    cos, sin = emb.cos(), emb.sin()
    got = rotary.rotary_embedding(positions, q, k, cos, sin)
    want = rotary.rotary_embedding_ref(positions, q, k, cos, sin)
    err = max(max_err(got[0], want[0]), max_err(got[1], want[1]))
    us = time_us(lambda: rotary.rotary_embedding(positions, q, k, cos, sin))
    base = time_us(lambda: rotary.rotary_embedding_ref(positions, q, k, cos, sin))
    gbps = 2 * tokens * (HEADS + KV_HEADS) * HEAD_DIM * size / us / 1e3
    rows.append(row("rotary", dtype, f"T={tokens} H={HEADS}/{KV_HEADS} D={HEAD_DIM}", err,
                    TOL[dtype], us, base, gbps))  # fmt: skip

    num_blocks = -(-tokens // BLOCK_SIZE) * 2
    caches = [torch.zeros(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=DEV)
              for _ in range(4)]  # fmt: skip
    slots = torch.randperm(num_blocks * BLOCK_SIZE, device=DEV)[:tokens]
    kv_write.write_kv_cache(k, v, caches[0], caches[1], slots)
    kv_write.write_kv_cache_ref(k, v, caches[2], caches[3], slots)
    exact = torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    us = time_us(lambda: kv_write.write_kv_cache(k, v, caches[0], caches[1], slots))
    base = time_us(lambda: kv_write.write_kv_cache_ref(k, v, caches[2], caches[3], slots))
    gbps = 4 * tokens * KV_HEADS * HEAD_DIM * size / us / 1e3
    rows.append(row("kv_write", dtype, f"T={tokens} Hkv={KV_HEADS} D={HEAD_DIM}",
                    0.0 if exact else float("inf"), 0.0, us, base, gbps))  # fmt: skip
    return rows


def commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True)
    except OSError:
        return None
    return out.stdout.decode().strip() or None


def print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'kernel':20} {'dtype':9} {'max_err':>9} {'ok':>3} {'µs':>9} {'torch µs':>9} "
          f"{'GB/s':>7} {'TFLOP/s':>7}  shape")  # fmt: skip
    for r in rows:
        base = f"{r['torch_us']:9.1f}" if r["torch_us"] else f"{'-':>9}"
        gbps = f"{r['gbps']:7.0f}" if r["gbps"] else f"{'-':>7}"
        tflops = f"{r['tflops']:7.1f}" if r["tflops"] else f"{'-':>7}"
        ok = "yes" if r["ok"] else "NO"
        print(f"{r['kernel']:20} {r['dtype']:9} {r['max_err']:9.2e} {ok:>3} {r['us']:9.1f} "
              f"{base} {gbps} {tflops}  {r['shape']}")  # fmt: skip


def main() -> int:
    if not torch.cuda.is_available():
        print("triton_kernels.py needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    torch.manual_seed(0)
    rows: list[dict[str, Any]] = []
    for dtype in (torch.bfloat16, torch.float32):
        rows.append(bench_decode(dtype, 64, 1024))
        rows.append(bench_decode(dtype, 2, 4000))  # split-K path
        rows.append(bench_decode(dtype, 8, 333))
        rows.append(bench_prefill(dtype, 4, 1024, 0))
        rows.append(bench_prefill(dtype, 2, 300, 1111))
        rows.extend(bench_elementwise(dtype, 4096))
    print_table(rows)
    report = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "commit": commit(),
        "rows": rows,
    }
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "kernels.json"
        path.write_text(json.dumps(report, indent=2))
        print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
