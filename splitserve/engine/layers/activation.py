"""Gated MLP activations on [T, 2 * I] laid out gate | up: SwiGLU's silu(gate) * up, its
clipped form (DeepSeek-V4), and GeGLU's gelu(gate) * up with the tanh approximation (Gemma's
``gelu_pytorch_tanh``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from splitserve.kernels.dispatch import use_kernels
from splitserve.kernels.native import decode as native


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_kernels(x):
        from splitserve.kernels.activation import silu_and_mul as kernel

        return kernel(x)
    if native.use_native(x):
        return native.silu_and_mul(x)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up


def clipped_silu_and_mul(x: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU with the gate clamped to at most ``limit`` and the up projection to
    [-limit, limit] first."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    if native.use_native(x):
        return native.gelu_tanh_and_mul(x)
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up
