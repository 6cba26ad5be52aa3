"""RMSNorm, computed in float32 like the reference implementation.

On CUDA the Triton kernels of ``splitserve.kernels.rmsnorm`` run it, fused with the residual add
before it; on the CPU the native kernel (``kernels/native/decode.c``) does the same in float32,
and this torch code is its reference.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.kernels.dispatch import use_kernels
from splitserve.kernels.native import decode as native


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_kernels(x):
            from splitserve.kernels.rmsnorm import rms_norm

            return rms_norm(x, self.weight, self.eps)
        if native.use_native(x) and self.weight.dtype == torch.float32:
            return native.add_rms_norm(x, None, self.weight, self.eps)[0]
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_and_norm(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (RMSNorm(x + residual), x + residual)."""
        if use_kernels(x):
            from splitserve.kernels.rmsnorm import fused_add_rms_norm

            return fused_add_rms_norm(x, residual, self.weight, self.eps)
        if native.use_native(x) and self.weight.dtype == torch.float32:
            return native.add_rms_norm(x, residual, self.weight, self.eps)
        summed = x + residual
        return self.forward(summed), summed
