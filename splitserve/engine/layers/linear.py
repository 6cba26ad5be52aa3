"""Projections, and the RMSNorm / SiLU around them, for one-row steps (batch-1 decode).

On the Triton path a one-row step runs each projection as the GEMV kernel of
``splitserve.kernels.gemv`` (cuBLAS leaves a third of the bandwidth unused at one row), with
the RMSNorm before it and the SiLU-and-mul after it folded into the same launch. Other steps
(prefill, batches, CPU) run each op on its own: the Triton RMSNorm and SiLU, cuBLAS for the
product. ``kernels.dispatch.set_decode_path`` picks the one-row variant for A/B benchmarks.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.norm import RMSNorm
from splitserve.kernels.dispatch import decode_path, use_kernels


def _one_row(x: torch.Tensor) -> bool:
    return x.shape[0] == 1 and use_kernels(x) and decode_path() != "separate"


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    if _one_row(x):
        from splitserve.kernels.gemv import gemv

        return gemv(x.contiguous(), layer.weight, layer.bias)[0]
    return layer(x)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    layer: nn.Linear,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer(RMSNorm(x + residual)), x + residual); residual None means x alone.

    gated: layer is a gate|up projection and the output is silu(gate) * up."""
    one_row = _one_row(x)
    if one_row and decode_path() == "fused":
        from splitserve.kernels.gemv import gemv

        out, summed = gemv(
            x.contiguous(),
            layer.weight,
            layer.bias,
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
        from splitserve.kernels.gemv import gemv

        return gemv(h.contiguous(), layer.weight, layer.bias, gated=gated)[0], residual
    out = layer(h)
    return (silu_and_mul(out) if gated else out), residual
