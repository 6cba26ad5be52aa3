"""cuBLAS's block-scaled FP8 GEMM (``torch._scaled_mm`` with 1 x 128 and 128 x 128 scales).

Since CUDA 12.9 cuBLAS multiplies e4m3 matrices with DeepSeek's scales on Hopper: one scale per
row and 128-channel group of the activations (``fp8_quant.quantize_groups``) and one per 128 x
128 block of the weight (``BlockFp8``), promoting each group's partial sums into the float32
accumulator on the way. Where torch passes those scales through (they must be float32, the
activations' laid out column-major), a prefill's products run at cuBLAS's FP8 rate, where the
Triton launch (``fp8_dense.py``) scales and adds each group's dot apart and reached 0.7-1.0x of
bfloat16 at 8,192 rows on an H100.

Whether this torch and GPU take the recipe is found once per device by a small product checked
against the dequantizing reference (``fp8_quant.fp8_matmul_ref``): a torch without the recipe
raises, and a wrong layout would give wrong numbers, so either way the engine keeps the Triton
launch. The CPU (the tests) never takes this path.
"""

from __future__ import annotations

import logging
from functools import cache

import torch

from splitserve.kernels.fp8_quant import (
    BLOCK,
    BlockFp8,
    fp8_matmul_ref,
    quantize_blocks,
    quantize_groups,
)

log = logging.getLogger(__name__)

ROW_ALIGN = 16
"""cuBLAS found no algorithm for row counts off this multiple (129 rows failed the probe on
an H200 with the scales' columns aligned): others are padded."""

MIN_ROWS = 128
"""Products of at least this many rows (prefill chunks, large batches) take cuBLAS where it
has the recipe; fewer rows stay on the Triton launches, which split K to fill the GPU."""


_refused: set[tuple[int, int, int]] = set()
"""Shapes cuBLAS refused although the probe passed (``refused``); they stay on Triton."""


def fits(m: int, n: int, k: int) -> bool:
    """Shapes cuBLAS's block-scaled path takes: whole 128-wide groups along K and N."""
    return m >= MIN_ROWS and n % BLOCK == 0 and k % BLOCK == 0 and (m, n, k) not in _refused


def refused(m: int, n: int, k: int, error: RuntimeError) -> None:
    """cuBLAS found no algorithm for this shape (it refuses before launching anything):
    logged once, and the shape takes the Triton launch from now on."""
    _refused.add((m, n, k))
    log.warning("cuBLAS's block-scaled FP8 GEMM refused %d x %d x %d: %s", m, n, k, error)


def block_scaled_mm(
    x: torch.Tensor, x_scale: torch.Tensor, weight: BlockFp8, out_dtype: torch.dtype
) -> torch.Tensor:
    """x [M, K] e4m3 with x_scale [M, K / 128] float32 times weight [N, K] e4m3 (scales [N /
    128, K / 128]) -> [M, N] in out_dtype (bfloat16 or float16), on cuBLAS. The rows as
    ``fp8_act.quantize_groups_kernel(for_cublas=True)`` gives them go as they are; others
    are padded and their scales copied."""
    m = x.shape[0]
    if m % ROW_ALIGN:  # rows padded with zeros (and scales of 1) to a whole multiple
        padded = -(-m // ROW_ALIGN) * ROW_ALIGN
        x = torch.cat(
            [x.view(torch.uint8), x.new_zeros((padded - m, x.shape[1]), dtype=torch.uint8)]
        ).view(x.dtype)
        x_scale = torch.cat([x_scale, x_scale.new_ones((padded - m, x_scale.shape[1]))])
    return torch._scaled_mm(
        x, weight.data.t(), scale_a=by_group(x_scale), scale_b=weight.scale.t(),
        out_dtype=out_dtype,
    )[:m]  # fmt: skip


def by_group(x_scale: torch.Tensor) -> torch.Tensor:
    """The activations' scales as cuBLAS reads them: column-major (each group's scales of every
    row side by side), columns 16-byte aligned (``quantize_groups_kernel(for_cublas=True)``
    writes them so; others are copied)."""
    m, groups = x_scale.shape
    if x_scale.stride(0) == 1 and x_scale.stride(1) % 4 == 0:
        return x_scale
    columns = x_scale.new_empty((groups, -(-m // 4) * 4))
    columns[:, :m] = x_scale.t()
    return columns[:, :m].t()


OUT_DTYPES = (torch.bfloat16, torch.float16)
"""Outputs cuBLAS gives for these scales: none in float32 (CUBLAS_STATUS_NOT_SUPPORTED), so a
float32 model's products stay on Triton rather than being refused at every row count."""


@cache
def available(device: torch.device, out_dtype: torch.dtype = torch.bfloat16) -> bool:
    """True when this device and torch multiply block-scaled FP8 on cuBLAS correctly with
    out_dtype's output: 129- and 256-row products by a 384 x 512 weight against the
    dequantizing reference (relative error under 1%)."""
    if device.type != "cuda" or out_dtype not in OUT_DTYPES:
        return False
    generator = torch.Generator(device=device).manual_seed(0)
    weight = quantize_blocks(torch.randn(384, 512, device=device, generator=generator))
    for rows in (MIN_ROWS + 1, 256):
        x_fp8, x_scale = quantize_groups(torch.randn(rows, 512, device=device, generator=generator))
        try:
            got = block_scaled_mm(x_fp8, x_scale, weight, out_dtype).float()
        except (RuntimeError, ValueError, TypeError):
            return False
        want = fp8_matmul_ref(x_fp8, x_scale, weight, torch.float32)
        if not (got - want).norm() <= 0.01 * want.norm():
            return False
    return True
