"""Projections, and the RMSNorm / SiLU around them, for one-row steps (batch-1 decode).

On the Triton path a one-row step runs each projection with a weight up to ``GEMV_MAX_BYTES``
as the GEMV kernel of ``splitserve.kernels.gemv``, with the RMSNorm before it and the
SiLU-and-mul after it folded into the same launch; an FP8 projection (``fp8_linear.py``) too,
its e4m3 weight read with its block scales (one byte a weight). Other steps (prefill,
batches) run each op on its own: the Triton RMSNorm and SiLU, cuBLAS for the product; on the
CPU the torch norm and SiLU and oneDNN for the product (``cpu_gemm.py``).
``kernels.dispatch.set_decode_path`` picks the one-row variant for A/B benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.cpu_gemm import onednn_linear, row_tiled, tiled_linear
from splitserve.engine.layers.fp8_linear import Fp8Linear
from splitserve.engine.layers.norm import RMSNorm
from splitserve.kernels.dispatch import decode_path, use_kernels

GEMV_MAX_BYTES = 256 << 20
"""Weights up to this size take the GEMV at one row: every projection of Llama-3-8B and
SmolLM2-135M (the lm_head stays on cuBLAS: SmolLM2's 57 MB of 576-wide rows took 26.6 us on
the GEMV against cuBLAS's 15.9, Llama-3-8B's 1 GB 231.6 against 237.2). On an
H200 with programmatic dependent launch (``kernels/pdl.py``), weights streamed from memory
inside a CUDA graph (benchmarks/gpu/fastpath.py): Llama-3-8B q|k|v 13.2 us against cuBLAS's
16.7, o 8.3 against 13.7, gate|up 53.6 against 55.7, down 27.2 against 31.5; SmolLM2 1.4-2.4
against 3.6-5.2 us. Without PDL the 235 MB gate|up lost to cuBLAS (61 against 56 us).

The norm is folded into every one of these GEMVs ("fused" path). Each program then reads the
whole row for the norm's sum of squares; with PDL that costs less than a norm launch even
beside Llama-3-8B's 50 MB q|k|v (14.2 us folded against 14.9 with the norm kernel) and 235 MB
gate|up (54.7 against 55.5); without PDL it did not (21.6 against 20.2 for q|k|v)."""


def _weight_bytes(layer: nn.Linear | Fp8Linear) -> int:
    return layer.weight.numel() * layer.weight.element_size()


def _one_row(x: torch.Tensor, layer: nn.Module) -> bool:
    """Whether this one-row step takes the GEMV (never in deterministic mode: one kernel for
    every row count)."""
    return (
        x.shape[0] == 1
        and isinstance(layer, (nn.Linear, Fp8Linear))
        and not row_tiled(layer)
        and use_kernels(x)
        and decode_path() != "separate"
        and _weight_bytes(layer) <= GEMV_MAX_BYTES
    )


def dense(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    """layer(x): the layer itself for quantized blocks (``block_linear.py``) and bfloat16
    weights (``bf16_linear.py``), in deterministic mode the batch-invariant product (the Triton
    kernel of ``invariant_matmul.py``, fixed row tiles on the CPU), oneDNN with a packed
    weight for float32 on the CPU where measured faster (``cpu_gemm.py``), else the layer
    itself (cuBLAS on CUDA, MKL on the CPU)."""
    if not isinstance(layer, nn.Linear):
        return layer(x)
    if row_tiled(layer):
        return _invariant(x, layer) if use_kernels(x) else tiled_linear(x, layer)
    out = onednn_linear(x, layer)
    return layer(x) if out is None else out


def _invariant(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    from splitserve.kernels.invariant_matmul import invariant_matmul  # Triton is optional

    return invariant_matmul(x, layer.weight, layer.bias)


def _gemv(
    x: torch.Tensor, layer: nn.Module, **fused: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GEMV kernel on layer's weight (imported here: Triton is optional); an FP8
    layer's weight with its block scales."""
    from splitserve.kernels.gemv import gemv

    if isinstance(layer, Fp8Linear):
        fused["weight_scale"] = layer.weight_scale_inv
    else:
        assert isinstance(layer, nn.Linear)
    return gemv(x.contiguous(), layer.weight, layer.bias, **fused)


def linear(x: torch.Tensor, layer: nn.Module) -> torch.Tensor:
    return _gemv(x, layer)[0] if _one_row(x, layer) else dense(x, layer)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    layer: nn.Module,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer(RMSNorm(x + residual)), x + residual); residual None means x alone.

    gated: layer is a gate|up projection and the output is silu(gate) * up."""
    one_row = _one_row(x, layer)
    if one_row and decode_path() == "fused":
        out, summed = _gemv(
            x,
            layer,
            residual=None if residual is None else residual.contiguous(),
            norm_weight=norm.weight,
            eps=norm.eps,
            gated=gated,
        )
        return out, x if summed is None else summed
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm.add_and_norm(x, residual)
    if one_row:
        return _gemv(h, layer, gated=gated)[0], residual
    out = dense(h, layer)
    return (silu_and_mul(out) if gated else out), residual
