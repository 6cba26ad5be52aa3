"""DeepSeek-V4's rotary embedding: the last ``rope_dim`` values of a head rotated in
(even, odd) pairs, cos and sin computed from the positions at each call (V4's contexts run
to a million positions: no tables)."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.rotary import attention_factor, inverse_frequencies
from splitserve.engine.v4_config import Rope


class InterleavedRope(nn.Module):
    def __init__(self, rope: Rope, rope_dim: int) -> None:
        super().__init__()
        self.rope_dim = rope_dim
        self.magnitude = attention_factor(rope.scaling)
        self.inv_freq: torch.Tensor
        freqs = inverse_frequencies(rope_dim, rope.theta, rope.scaling)
        self.register_buffer("inv_freq", freqs, persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [T, rope_dim / 2] in float32 for positions [T]."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return freqs.cos() * self.magnitude, freqs.sin() * self.magnitude


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, ..., D] with its last 2 * cos.shape[-1] values rotated by cos, sin [T, half]
    (pass -sin for the inverse rotation), in float32, returned in x's dtype."""
    half = cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    rope = x[..., -2 * half :].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]
    turned = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
    return torch.cat([x[..., : -2 * half], turned.flatten(-2).to(x.dtype)], dim=-1)
