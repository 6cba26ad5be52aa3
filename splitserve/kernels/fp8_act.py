"""Activations into FP8 for the FP8 x FP8 GEMM: one launch where ``fp8_quant.quantize_groups``
(the torch reference) takes several passes over the rows.

Each program takes ``ROWS`` rows and one 128-channel group: a row's largest magnitude there
over 448 is its group's float32 scale (``TINY`` at least), and every value divided by it,
clamped to e4m3's range and rounded to nearest even, is its e4m3 value: the reference's
arithmetic, so the two agree bit for bit. The rounding is done in float32 before the cast
(which is then exact): Triton's interpreter, which the CPU tests run, carries no rounding into
the exponent when it casts to e4m3 (1.9 became 1.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.fp8_cublas import ROW_ALIGN
from splitserve.kernels.fp8_quant import BLOCK, FP8, FP8_MAX, TINY, blocks


@triton.jit
def round_to_e4m3(q):
    """float32 values within e4m3's range rounded to its grid (3 mantissa bits; a step of
    2^-9 below 2^-6): adding and taking away 1.5 * 2^23 steps rounds to nearest even, so the
    cast to e4m3 after it is exact."""
    bits = q.to(tl.int32, bitcast=True)
    exponent = tl.maximum((bits >> 23) & 0xFF, 127 - 6)  # subnormals share 2^-6's step
    magic = ((exponent + 20) << 23 | 0x400000).to(tl.float32, bitcast=True)
    rounded = (tl.abs(q) + magic) - magic
    return tl.where(bits < 0, -rounded, rounded)  # a negative value rounded to 0 is -0


@triton.jit
def _quantize_kernel(
    x_ptr, out_ptr, scale_ptr, M, M_OUT, K,
    stride_x, stride_out, stride_scale_m, stride_scale_g,
    ROWS: tl.constexpr, GROUP: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    """Rows M..M_OUT (padding) are written as zeros."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    load = (rows < M)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=load, other=0.0)
    x = x.to(tl.float32)
    # IEEE divisions (Triton's "/" is the GPU's approximate one), as torch divides
    scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), TINY), FP8_MAX)
    q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale[:, None]), -FP8_MAX), FP8_MAX))
    out = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(
        out, q.to(out_ptr.dtype.element_ty), mask=(rows < M_OUT)[:, None] & (cols < K)[None, :]
    )
    scale_at = scale_ptr + rows * stride_scale_m + group * stride_scale_g
    tl.store(scale_at, scale, mask=rows < M_OUT)


ROWS = 16
"""Rows a program quantizes (one 128-channel group of each): one row a program left a
prefill's 8,192 x 14,336 activations 917,504 programs of 128 values, 585 µs on an H200."""


def quantize_groups_kernel(
    x: torch.Tensor, for_cublas: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quant.quantize_groups`` in one launch: x [M, K] -> (e4m3 [M, K], float32 scales
    [M, ceil(K / 128)]). for_cublas: laid out as ``fp8_cublas.block_scaled_mm`` takes them,
    the rows padded with zero rows to a multiple of ``fp8_cublas.ROW_ALIGN`` and the scales
    column-major (each group's scales of every row side by side)."""
    m, k = x.shape
    assert x.stride(1) == 1
    rows = -(-m // ROW_ALIGN) * ROW_ALIGN if for_cublas else m
    out = torch.empty((rows, k), dtype=FP8, device=x.device)
    groups = blocks(k)
    if for_cublas:
        scale = torch.empty((groups, rows), device=x.device).t()
    else:
        scale = torch.empty((m, groups), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(triton.cdiv(rows, ROWS), groups)](
            x, out, scale, m, rows, k, x.stride(0), out.stride(0), scale.stride(0),
            scale.stride(1), ROWS=ROWS, GROUP=BLOCK, FP8_MAX=FP8_MAX, TINY=TINY,
        )  # fmt: skip
    return out, scale
