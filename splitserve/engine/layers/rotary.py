"""Rotary position embedding (rotate-half layout) with Llama 2/3 style scaling.

On CUDA the Triton kernel of ``splitserve.kernels.rotary`` applies it; on the CPU this torch code
(decode rows take the native kernel with the K/V write and attention, ``layers/attention.py``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from splitserve.kernels.dispatch import use_kernels


def inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if not scaling:
        return inv_freq
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_scaling(inv_freq, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _llama3_scaling(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self._build(self.inv_freq)

    def set_frequency_factors(self, factors: torch.Tensor) -> None:
        """GGUF Llama 3 files carry their scaling as per-frequency divisors."""
        self._build(self.inv_freq / factors.float().cpu())

    def _build(self, inv_freq: torch.Tensor) -> None:
        positions = torch.arange(self.max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        device = self.cos.device if hasattr(self, "cos") else None
        self.register_buffer("cos", emb.cos().to(device), persistent=False)
        self.register_buffer("sin", emb.sin().to(device), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D] -> rotated, in their dtype."""
        if use_kernels(q):
            from splitserve.kernels.rotary import rotary_embedding

            return rotary_embedding(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)
