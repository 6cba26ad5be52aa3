"""FP8 projections (``EngineConfig.quantization="fp8"``): block-scaled e4m3 weights.

Every projection of the decoder layers (attention, dense MLP, shared experts) becomes an
``Fp8Linear`` and every stack of routed experts holds its weights in e4m3, each with one
float32 scale per 128 x 128 block (DeepSeek-V3's scheme, ``kernels/fp8_quant.py``). The
embeddings, the LM head, the norms, the MoE router and MLA's latent up-projection
(``kv_b_proj``, which decode splits into the absorbed matrices) stay in the model's dtype.

A product quantizes its input per token and 128-channel group, then runs the FP8 x FP8 GEMM:
the Triton kernels where the kernels run (``kernels/fp8_dense.py``; ``kernels/grouped_gemm.py``
for experts), products of ``fp8_cublas.MIN_ROWS`` rows or more on cuBLAS's block-scaled path
where the GPU's torch has it (``kernels/fp8_cublas.py``), else the dequantizing torch
reference (slow, but every test and deployment shape runs on the CPU). Where the kernels run
and on the CPU, products of a few rows (decode) skip the quantization and take the rows as
they are against the dequantized weights (``W8A16_MAX_ROWS``); on the kernels one row goes
through the fused GEMV (``layers/linear.py``).

Which modules become FP8, and how a checkpoint gets there: ``engine/fp8_weights.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels import fp8_cublas
from splitserve.kernels.dispatch import use_kernels
from splitserve.kernels.fp8_quant import (
    FP8,
    BlockFp8,
    blocks,
    dequantize_blocks,
    dequantize_groups,
    fp8_grouped_ref,
    quantize_groups,
)

W8A16_MAX_ROWS = 16
"""Products of up to this many rows (an expert stack: this many rows per expert on average)
keep the rows in their dtype and meet the dequantized weights (W8A16: the weights' bytes are
the bound there, and quantizing the rows would cost a launch and accuracy); more rows are
quantized per token and group and run FP8 x FP8. The CPU path does the same arithmetic. At
64 rows of Llama-3-8B's projections on an H100 the W8A8 launch took 131 us against W8A16's
178 (bfloat16 163; ``benchmarks/kernels/fp8_gemm.py --sweep``): widening a weight tile to
the rows' dtype costs more than quantizing the rows once the tile has 64 of them."""

SCALE_SUFFIX = "_scale_inv"
"""A quantized parameter's scales sit beside it under its name + this (DeepSeek's naming)."""


def fp8_linear(
    x: torch.Tensor, weight: BlockFp8, dequantized: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, K] (float) times the block-quantized weight [N, K] -> [M, N] in x's dtype.
    dequantized: the weight's float32 values, where the caller keeps them (the reference
    path then skips dequantizing it again). Up to ``W8A16_MAX_ROWS`` rows stay unquantized."""
    few = x.shape[0] <= W8A16_MAX_ROWS
    if use_kernels(x):
        from splitserve.kernels.fp8_act import quantize_groups_kernel
        from splitserve.kernels.fp8_dense import fp8_dense_gemm

        if few:
            return fp8_dense_gemm(x.contiguous(), None, weight, x.dtype)
        n, k = weight.data.shape
        if fp8_cublas.fits(x.shape[0], n, k) and fp8_cublas.available(x.device, x.dtype):
            quantized = quantize_groups_kernel(x.contiguous(), for_cublas=True)
            try:
                return fp8_cublas.block_scaled_mm(*quantized, weight, x.dtype)[: x.shape[0]]
            except RuntimeError as error:
                fp8_cublas.refused(x.shape[0], n, k, error)
        return fp8_dense_gemm(*quantize_groups_kernel(x.contiguous()), weight, x.dtype)
    rows = x.float() if few else dequantize_groups(*quantize_groups(x))
    if dequantized is None:
        dequantized = dequantize_blocks(weight)
    return F.linear(rows, dequantized).to(x.dtype)


def fp8_grouped(
    x: torch.Tensor, weight: BlockFp8, offsets: torch.Tensor, rows: torch.Tensor | None
) -> torch.Tensor:
    """``moe.grouped_gemm`` with FP8 experts: x's tokens are quantized once, before the rows
    are gathered from them; unquantized while the experts get ``W8A16_MAX_ROWS`` rows each
    on average or fewer (decode)."""
    count = x.shape[0] if rows is None else rows.numel()
    few = count <= W8A16_MAX_ROWS * weight.data.shape[0]
    if use_kernels(x):
        from splitserve.kernels.fp8_act import quantize_groups_kernel
        from splitserve.kernels.grouped_gemm import fp8_grouped_gemm

        if few:
            return fp8_grouped_gemm(x.contiguous(), None, weight, offsets, x.dtype, rows)
        x_fp8, x_scale = quantize_groups_kernel(x.contiguous())
        return fp8_grouped_gemm(x_fp8, x_scale, weight, offsets, x.dtype, rows)
    if few:
        return fp8_grouped_ref(x if rows is None else x[rows], None, weight, offsets, x.dtype)
    x_fp8, x_scale = quantize_groups(x)
    if rows is not None:  # gathered as bytes: torch indexes no float8 tensor on some versions
        x_fp8, x_scale = x_fp8.view(torch.uint8)[rows].view(FP8), x_scale[rows]
    return fp8_grouped_ref(x_fp8, x_scale, weight, offsets, x.dtype)


class Fp8Linear(nn.Module):
    """y = x @ W.T (+ bias) with W in e4m3 blocks: ``weight`` [N, K] float8_e4m3fn and
    ``weight_scale_inv`` [ceil(N / 128), ceil(K / 128)] float32 (DeepSeek's names, so that
    an FP8 checkpoint's tensors load into them as they are)."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        data = torch.zeros(out_features, in_features, dtype=FP8)
        scale = torch.ones(blocks(out_features), blocks(in_features), dtype=torch.float32)
        self.weight = nn.Parameter(data, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.reference: torch.Tensor | None = None
        """The CPU path's float32 copy of the dequantized weight, made at its first product
        (the reference arithmetic at float32 speed, for float32 memory)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        weight = BlockFp8(self.weight, self.weight_scale_inv)
        if not use_kernels(flat) and self.reference is None:
            self.reference = dequantize_blocks(weight)
        out = fp8_linear(flat, weight, self.reference)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, fp8 e4m3 128x128 blocks"
