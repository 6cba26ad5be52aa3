"""Rotary position embedding (rotate-half layout) with Llama 2/3 style and YaRN scaling.

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
    if kind == "yarn":
        return _yarn_scaling(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling {kind!r}")


def _yarn_scaling(
    inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict[str, Any]
) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are divided by ``factor``, those past ``beta_fast`` kept, a linear ramp between (over the
    dimension index, its ends rounded outward unless ``truncate`` is false)."""
    factor = float(scaling["factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    fast, slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dimension(turns: float) -> float:
        return head_dim * math.log(old_len / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension(fast), dimension(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def attention_factor(scaling: dict[str, Any] | None) -> float:
    """What YaRN multiplies cos and sin by (1 for other kinds): ``attention_factor`` where
    the config sets it, else mscale(factor, mscale) / mscale(factor, mscale_all_dim)."""
    if not scaling or scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return _yarn_mscale(factor, float(mscale)) / _yarn_mscale(factor, float(all_dim))
    return _yarn_mscale(factor)


def softmax_scale_factor(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's MLA multiplies its softmax scale by mscale(factor, mscale_all_dim) squared
    under any rope scaling whose config sets ``mscale_all_dim``."""
    if not scaling or not scaling.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(float(scaling["factor"]), float(scaling["mscale_all_dim"])) ** 2


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
        self.magnitude = attention_factor(scaling)
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
        cos, sin = emb.cos() * self.magnitude, emb.sin() * self.magnitude
        self.register_buffer("cos", cos.to(device), persistent=False)
        self.register_buffer("sin", sin.to(device), persistent=False)

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
