"""Projections, and the RMSNorm / SiLU around them, for one-row steps (batch-1 decode).

On the Triton path a one-row step runs each projection with a weight up to ``GEMV_MAX_BYTES``
as the GEMV kernel of ``splitserve.kernels.gemv``, with the RMSNorm before it and the
SiLU-and-mul after it folded into the same launch. Other steps (prefill, batches) run each op
on its own: the Triton RMSNorm and SiLU, cuBLAS for the product; on the CPU the torch norm and
SiLU and oneDNN for the product (``cpu_gemm.py``). ``kernels.dispatch.set_decode_path`` picks
the one-row variant for A/B benchmarks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from splitserve.engine.layers.activation import silu_and_mul
from splitserve.engine.layers.cpu_gemm import onednn_linear
from splitserve.engine.layers.norm import RMSNorm
from splitserve.kernels.dispatch import decode_path, use_kernels

GEMV_MAX_BYTES = 128 << 20
"""Weights up to this size take the GEMV at one row. On an H200, weights streamed from memory
(benchmarks/gpu_fastpath.py): the GEMV beats cuBLAS on every SmolLM2-135M projection (2.5-3.7
against 3.6-5.2 us) and on Llama-3-8B's o (11.5 against 13.6 us) and down (31.8 against
32.8); the 235 MB gate|up stays on cuBLAS (61 against 56 us in one run, 62 against 61 in
another). End to end, Llama-3-8B batch 1 with this limit against 16 MB (all of its
projections on cuBLAS), same run each (benchmarks/gpu_fastpath.sh): 202.4 against 197.4 tok/s
on one machine, 210.8 against 211.1 on another."""

NORM_FOLD_MAX_BYTES = 16 << 20
"""The norm is folded into the GEMV only for weights up to this size. Every program of the
GEMV reads the whole row for the norm's sum of squares: beside a few KB of weights per program
(SmolLM2: q|k|v 3.0 us folded against 4.3 with the norm kernel) that is cheap, beside 50 MB
split over 1,536 programs it is not (Llama-3-8B q|k|v: 21.6 against 20.2 us)."""


def _weight_bytes(layer: nn.Linear) -> int:
    return layer.weight.numel() * layer.weight.element_size()


def _one_row(x: torch.Tensor, layer: nn.Linear) -> bool:
    return (
        x.shape[0] == 1
        and use_kernels(x)
        and decode_path() != "separate"
        and _weight_bytes(layer) <= GEMV_MAX_BYTES
    )


def dense(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    """layer(x): oneDNN with a packed weight for float32 on the CPU (``cpu_gemm.py``), else
    the layer itself (cuBLAS on CUDA)."""
    out = onednn_linear(x, layer)
    return layer(x) if out is None else out


def _gemv(
    x: torch.Tensor, layer: nn.Linear, **fused: Any
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The GEMV kernel on layer's weight (imported here: Triton is optional)."""
    from splitserve.kernels.gemv import gemv

    return gemv(x.contiguous(), layer.weight, layer.bias, **fused)


def linear(x: torch.Tensor, layer: nn.Linear) -> torch.Tensor:
    return _gemv(x, layer)[0] if _one_row(x, layer) else dense(x, layer)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm: RMSNorm,
    layer: nn.Linear,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (layer(RMSNorm(x + residual)), x + residual); residual None means x alone.

    gated: layer is a gate|up projection and the output is silu(gate) * up."""
    one_row = _one_row(x, layer)
    if one_row and decode_path() == "fused" and _weight_bytes(layer) <= NORM_FOLD_MAX_BYTES:
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
