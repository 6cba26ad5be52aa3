"""Projections, and the RMSNorm / SiLU around them, fused into one kernel for small batches.

With at most ``MAX_ROWS`` rows on the Triton path (decode at small batch) a norm + projection
runs as one launch of ``splitserve.kernels.skinny_linear`` and the gate|up projection applies
SiLU-and-mul in the same launch; otherwise (prefill, large batches, CPU) each op runs on its
own: the Triton RMSNorm and SiLU, cuBLAS for the product.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.norm import RMSNorm
from splitserve.kernels.dispatch import fused_small_batch, use_kernels


def _skinny(x: torch.Tensor) -> bool:
    if not (use_kernels(x) and fused_small_batch()):
        return False
    from splitserve.kernels.skinny_linear import MAX_ROWS

    return x.shape[0] <= MAX_ROWS


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    if _skinny(x):
        from splitserve.kernels.skinny_linear import skinny_linear

        return skinny_linear(x, layer.weight, layer.bias)[0]
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
    if _skinny(x):
        from splitserve.kernels.skinny_linear import skinny_linear

        out, summed = skinny_linear(
            x,
            layer.weight,
            layer.bias,
            residual=residual,
            norm_weight=norm.weight,
            eps=norm.eps,
            gated=gated,
        )
        return out, x if summed is None else summed
    if residual is None:
        h, residual = norm(x), x
    else:
        h, residual = norm.add_and_norm(x, residual)
    out = layer(h)
    return (silu_and_mul(out) if gated else out), residual
