"""Activations into FP8 for the FP8 x FP8 GEMM: one launch where ``fp8_quant.quantize_groups``
(the torch reference) takes several passes over the rows.

Each program takes one row and one 128-channel group: its largest magnitude over 448 is the
group's float32 scale (``TINY`` at least), and every value divided by it, clamped to e4m3's
range and rounded to nearest even, is its e4m3 value: the reference's arithmetic, so the
two agree bit for bit. The rounding is done in float32 before the cast (which is then exact):
Triton's interpreter, which the CPU tests run, carries no rounding into the exponent when it
casts to e4m3 (1.9 became 1.0).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.fp8_quant import BLOCK, FP8, FP8_MAX, TINY, blocks


@triton.jit
def round_to_e4m3(q):
    """float32 values within e4m3's range rounded to its grid (3 mantissa bits; a step of
    2^-9 below 2^-6): adding and taking away 1.5 * 2^23 steps rounds to nearest even, so the
    cast to e4m3 after it is exact."""
    exponent = (q.to(tl.int32, bitcast=True) >> 23) & 0xFF
    exponent = tl.maximum(exponent, 127 - 6)  # e4m3's subnormals share 2^-6's step
    magic = ((exponent + 20) << 23 | 0x400000).to(tl.float32, bitcast=True)
    return (q + magic) - magic


@triton.jit
def _quantize_kernel(
    x_ptr, out_ptr, scale_ptr, K, stride_x, stride_out, stride_scale,
    GROUP: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    mask = cols < K
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), 0), TINY) / FP8_MAX
    q = round_to_e4m3(tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX))
    tl.store(out_ptr + row * stride_out + cols, q.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr + row * stride_scale + group, scale)


def quantize_groups_kernel(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fp8_quant.quantize_groups`` in one launch: x [M, K] -> (e4m3 [M, K], float32 scales
    [M, ceil(K / 128)])."""
    m, k = x.shape
    assert x.stride(1) == 1
    out = torch.empty((m, k), dtype=FP8, device=x.device)
    scale = torch.empty((m, blocks(k)), dtype=torch.float32, device=x.device)
    if m:
        _quantize_kernel[(m, blocks(k))](
            x, out, scale, k, x.stride(0), out.stride(0), scale.stride(0),
            GROUP=BLOCK, FP8_MAX=FP8_MAX, TINY=TINY,
        )  # fmt: skip
    return out, scale
