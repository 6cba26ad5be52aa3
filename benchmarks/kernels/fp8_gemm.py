"""The FP8 GEMM (``kernels/fp8_dense.py``) on Llama-3-8B's four projections,
beside bfloat16 (cuBLAS) and ``torch._scaled_mm`` with row-wise scales (cuBLAS's FP8 path),
in one run (issue 42).

For each projection (q|k|v 6144 x 4096, o 4096 x 4096, gate|up 28672 x 4096, down 4096 x
14336) and row count (1, 64, 256, 8192): the kernel's largest error against the dequantizing
reference (``fp8_matmul_ref``), then the time of bfloat16 ``F.linear``, of ``_scaled_mm``
(activations quantized per row, weights per output channel: its row-wise recipe), of the
kernel alone (activations already quantized) and of the kernel with the per-token-group
quantization before it (what a projection costs in the engine), and of cuBLAS's block-scaled
path (``kernels/fp8_cublas.py``, with and without the quantization) where torch has it; the
speedups over bfloat16 and GB/s on the bytes each reads (FP8: one byte a weight, plus the
scales).

    python -m benchmarks.kernels.fp8_gemm            # on the GPU machine; $OUT/fp8_gemm.json
    python -m benchmarks.kernels.fp8_gemm --sweep    # weights from memory, CUDA graphs: every
                                                     # variant (FP8 GEMV, W8A16, W8A8) and
                                                     # tiling; $OUT/fp8_gemm_sweep.json
    TRITON_INTERPRET=1 python -m benchmarks.kernels.fp8_gemm --device cpu --small
                                                     # a smoke run of the checks, no timing
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
import triton
import triton.testing

from splitserve.bench.report import git_commit
from splitserve.kernels import fp8_cublas
from splitserve.kernels.fp8_act import quantize_groups_kernel
from splitserve.kernels.fp8_dense import (
    DenseTiles,
    choose_dense_tiles,
    fp8_dense_gemm,
    multiprocessors,
)
from splitserve.kernels.fp8_quant import (
    FP8,
    FP8_MAX,
    dequantize_blocks,
    fp8_matmul_ref,
    quantize_blocks,
    quantize_groups,
)
from splitserve.kernels.gemv import Tiles, gemv
from splitserve.kernels.grouped_gemm import fp8_gemm

PROJECTIONS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
ROWS = (1, 64, 256, 8192)
SMALL = {"qkv": (192, 128), "down": (128, 320)}, (1, 16)


def time_us(fn: Callable[[], Any], device: torch.device, iters: int = 50) -> float:
    """Mean time of one call in µs (CUDA events after warm-up; wall clock elsewhere)."""
    for _ in range(3):
        fn()
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e6
    torch.cuda.synchronize()
    start_ev, end_ev = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start_ev.record()
    for _ in range(iters):
        fn()
    end_ev.record()
    torch.cuda.synchronize()
    return start_ev.elapsed_time(end_ev) * 1000 / iters


def rowwise(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_scaled_mm's row-wise recipe: e4m3 values and one float32 scale per row."""
    scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def case(name: str, n: int, k: int, rows: int, device: torch.device) -> dict[str, Any]:
    torch.manual_seed(0)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    w = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    x = torch.randn(rows, k, device=device).to(dtype)
    weight = quantize_blocks(w)
    x_fp8, x_scale = quantize_groups(x)
    out = fp8_dense_gemm(x_fp8, x_scale, weight, torch.float32)
    ref = fp8_matmul_ref(x_fp8, x_scale, weight, torch.float32)
    err = ((out - ref).abs() / (1 + ref.abs())).max().item()
    result: dict[str, Any] = {"gemm": name, "n": n, "k": k, "rows": rows, "max_err": err}
    if device.type != "cuda":
        return result
    fp8_bytes = n * k + weight.scale.numel() * 4 + rows * k + rows * n * 2
    times = {
        "bf16_us": time_us(lambda: F.linear(x, w), device),
        "kernel_us": time_us(lambda: fp8_dense_gemm(x_fp8, x_scale, weight, dtype), device),
        "kernel_with_quant_us": time_us(
            lambda: fp8_dense_gemm(*quantize_groups_kernel(x), weight, dtype), device
        ),
        "quant_kernel_us": time_us(lambda: quantize_groups_kernel(x), device),
    }
    result["cublas_block_available"] = fp8_cublas.available(device)
    try:  # every row count, also those the engine keeps off it (fp8_cublas.MIN_ROWS)
        block = fp8_cublas.block_scaled_mm(x_fp8, x_scale, weight, torch.bfloat16).float()
        result["cublas_block_err"] = ((block - ref).abs() / (1 + ref.abs())).max().item()
        times["cublas_block_us"] = time_us(
            lambda: fp8_cublas.block_scaled_mm(x_fp8, x_scale, weight, dtype), device
        )
        times["cublas_block_with_quant_us"] = time_us(
            lambda: fp8_cublas.block_scaled_mm(
                *quantize_groups_kernel(x, for_cublas=True), weight, dtype
            ),
            device,
        )
    except RuntimeError as exc:
        result["cublas_block_error"] = str(exc)[:200]
    w_row, w_scale = rowwise(w)
    x_row, x_row_scale = rowwise(x)
    times["scaled_mm_us"] = time_us(
        lambda: torch._scaled_mm(
            x_row, w_row.t(), scale_a=x_row_scale, scale_b=w_scale.t(), out_dtype=dtype
        ),
        device,
    )
    result |= times
    result |= {f"{key[:-3]}_x_bf16": times["bf16_us"] / us for key, us in times.items()}
    result["kernel_gb_per_s"] = fp8_bytes / times["kernel_us"] / 1e3
    return result


def sweep_tiles(rows: int) -> list[DenseTiles]:
    """The dense launch's tilings tried at a row count: the smallest row tile that holds the
    rows with 32-128 columns and split-K for decode (W8A16), 64/128-row tiles for prefill
    (W8A8)."""
    if rows <= 64:
        block_m = 16 if rows <= 16 else 64
        return [
            DenseTiles(block_m, bn, split_k=split, num_warps=warps)
            for bn in (32, 64, 128)
            for split in (1, 2, 4)
            for warps in (4, 8)
            if not (bn == 32 and warps == 8)
        ]
    return [
        DenseTiles(bm, bn, num_warps=warps, num_stages=stages)
        for bm in (64, 128)
        for bn in (64, 128)
        for warps in (4, 8)
        for stages in (3, 4)
    ]


GEMV_TILES = [
    Tiles(bn, bk, warps) for bn in (4, 8, 16) for bk in (512, 1024, 2048) for warps in (4, 8)
]


def cold_us(fn: Callable[[Any], Any], copies: list[Any]) -> float:
    """µs per call of fn(weight) with the weight cycling through copies larger than the L2
    cache together (as a model's layers read theirs), replayed from a CUDA graph."""

    def run_all() -> None:
        for w in copies:
            fn(w)

    return float(triton.testing.do_bench_cudagraph(run_all, rep=30)) * 1000 / len(copies)


def try_cold_us(fn: Callable[[Any], Any], copies: list[Any]) -> float:
    try:
        return cold_us(fn, copies)
    except Exception as exc:  # a tiling past the shared memory or registers
        print(f"skipped: {type(exc).__name__}: {str(exc)[:80]}", flush=True)
        return float("inf")


def sweep(name: str, n: int, k: int, rows: int, device: torch.device) -> dict[str, Any]:
    """One projection at one row count, weights streamed from memory: bfloat16 (cuBLAS, and
    the GEMV at one row), the FP8 GEMV at one row, the FP8 GEMM on unquantized rows (W8A16)
    up to 256 rows and on quantized rows (W8A8, the quantization launch included) from 64,
    each at every tiling of the sweep, and ``_scaled_mm`` (rows quantized beforehand)."""
    dtype = torch.bfloat16
    count = max(2, -(-(512 << 20) // (n * k * 2)))
    dense = [(torch.randn(n, k, device=device) / k**0.5).to(dtype) for _ in range(count)]
    fp8 = [quantize_blocks(w) for w in dense]
    x = torch.randn(rows, k, device=device).to(dtype)
    ref = x.float() @ dequantize_blocks(fp8[0]).T
    sms = multiprocessors(device)
    result: dict[str, Any] = {"gemm": name, "n": n, "k": k, "rows": rows}
    result["bf16_us"] = cold_us(lambda w: F.linear(x, w), dense)
    variants: dict[str, dict[str, float]] = {}
    if rows == 1:
        result["bf16_gemv_us"] = cold_us(lambda w: gemv(x, w), dense)
        out, _ = gemv(x, fp8[0].data, weight_scale=fp8[0].scale)
        result["gemv_err"] = ((out.float() - ref).norm() / ref.norm()).item()
        variants["fp8_gemv"] = {
            str(t): try_cold_us(lambda w, t=t: gemv(x, w.data, weight_scale=w.scale, tiles=t), fp8)
            for t in GEMV_TILES
        }
    if rows <= 64:
        out = fp8_dense_gemm(x, None, fp8[0], dtype)
        result["w8a16_err"] = ((out.float() - ref).norm() / ref.norm()).item()
        result["w8a16_default_tiles"] = str(choose_dense_tiles(rows, n, k, False, sms))
        result["w8a16_default_us"] = cold_us(lambda w: fp8_dense_gemm(x, None, w, dtype), fp8)
        result["grouped_w8a16_us"] = cold_us(lambda w: fp8_gemm(x, None, w, dtype), fp8)
        variants["w8a16"] = {
            str(t): try_cold_us(lambda w, t=t: fp8_dense_gemm(x, None, w, dtype, t), fp8)
            for t in sweep_tiles(rows)
        }
    if rows >= 64:
        out = fp8_dense_gemm(*quantize_groups_kernel(x), fp8[0], dtype)
        result["w8a8_err"] = ((out.float() - ref).norm() / ref.norm()).item()
        result["w8a8_default_us"] = cold_us(
            lambda w: fp8_dense_gemm(*quantize_groups_kernel(x), w, dtype), fp8
        )
        result["grouped_w8a8_us"] = cold_us(
            lambda w: fp8_gemm(*quantize_groups_kernel(x), w, dtype), fp8
        )
        variants["w8a8"] = {
            str(t): try_cold_us(
                lambda w, t=t: fp8_dense_gemm(*quantize_groups_kernel(x), w, dtype, t), fp8
            )
            for t in sweep_tiles(max(rows, 128))
        }
    rowwise_copies = [rowwise(w) for w in dense[:2]]
    x_row, x_row_scale = rowwise(x)
    result["scaled_mm_us"] = cold_us(
        lambda w: torch._scaled_mm(
            x_row, w[0].t(), scale_a=x_row_scale, scale_b=w[1].t(), out_dtype=dtype
        ),
        rowwise_copies,
    )
    for kind, timings in variants.items():
        best = min(timings, key=lambda t: timings[t])
        result[f"{kind}_best_us"], result[f"{kind}_best_tiles"] = timings[best], best
        result[f"{kind}_x_bf16"] = result["bf16_us"] / timings[best]
    result["variants"] = variants
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="tiny shapes (an interpreter run)")
    parser.add_argument(
        "--sweep", action="store_true", help="weights from memory, every variant and tiling"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.sweep:
        sweeps = []
        for name, (n, k) in PROJECTIONS.items():
            for m in ROWS:
                sweeps.append(sweep(name, n, k, m, device))
                print(json.dumps({k: v for k, v in sweeps[-1].items() if k != "variants"}))
                if os.environ.get("OUT"):  # after each case: a run cut short keeps its part
                    with open(os.path.join(os.environ["OUT"], "fp8_gemm_sweep.json"), "w") as f:
                        json.dump({"commit": git_commit(), "sweeps": sweeps}, f, indent=1)
    projections, rows = SMALL if args.small else (PROJECTIONS, ROWS)
    results = []
    for name, (n, k) in projections.items():
        for m in rows:
            results.append(case(name, n, k, m, device))
            print(json.dumps(results[-1]), flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    record = {"benchmark": "fp8_gemm", "commit": git_commit(), "device": name, "rows": results}
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "fp8_gemm.json"), "w") as f:
            json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
