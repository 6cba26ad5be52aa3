"""DeepSeek-V4's compressors: ``rate`` consecutive tokens pooled into one compressed entry.

Each token projects to values ``kv`` and gate logits ``gate`` (plus a learned bias for its
offset in the window); an entry is the per-channel softmax over the gate logits of the
window's values, RMS-normed, then rotated (the compress rope) at the window's first
position. HCA's windows do not overlap (``width = dim``). CSA's do (``width = 2 * dim``):
each token carries two series, the first ``dim`` values pooled into the next window's
entry, the last ``dim`` into its own, so entry w pools 2 * rate slots: window w - 1's first
series and window w's second (entry 0's earlier half empty).

A token's projections are kept as one row, kv | gate (``project``): the engine stores them
in the token's window row (``layers/v4_cache.py``) and pools the rows of a window's tokens
when its last one is computed (``pool``).
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.interleaved_rope import InterleavedRope, rotate
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm


class Compressor(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        dim: int,
        rate: int,
        overlap: bool,
        rope: InterleavedRope,
        norm_eps: float,
    ) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.width = 2 * dim if overlap else dim
        self.kv_proj = nn.Linear(hidden_size, self.width, bias=False)
        self.gate_proj = nn.Linear(hidden_size, self.width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, self.width, dtype=torch.float32))
        self.kv_norm = RMSNorm(dim, norm_eps)
        self.rope = rope

    @property
    def row_width(self) -> int:
        """Values a token's projections take: kv | gate."""
        return 2 * self.width

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """Normed hidden states [T, H] -> their rows [T, row_width]."""
        return torch.cat([dense(x, self.kv_proj), dense(x, self.gate_proj)], dim=-1)

    def pool(self, rows: torch.Tensor, windows: torch.Tensor, base: int = 0) -> torch.Tensor:
        """The entries [n, dim] of ``windows`` [n] from the rows [C, row_width] of positions
        ``base`` .. ``base + C - 1`` (every window's tokens among them)."""
        reach = 2 * self.rate if self.overlap else self.rate
        offsets = torch.arange(self.rate - reach, self.rate, device=rows.device)
        slots = (windows[:, None] * self.rate + offsets - base).clamp(min=0)
        return self.pool_windows(rows[slots], windows)

    def pool_windows(self, rows: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """The entries [n, dim] of ``windows`` [n] from each one's rows [n, reach, row_width]:
        its ``rate`` tokens' (CSA: after the ``rate`` of the window before, whatever they hold
        for window 0)."""
        rate, dim = self.rate, self.dim
        kv = rows[:, -rate:, : self.width]
        gate = rows[:, -rate:, self.width :].float() + self.position_bias
        if self.overlap:
            earlier = rows[:, :rate]
            first = windows[:, None, None] > 0  # window 0 has no earlier one
            kv_a = torch.where(first, earlier[..., :dim], 0.0)
            bias = self.position_bias[:, :dim]
            gate_a = earlier[..., self.width : self.width + dim].float() + bias
            gate_a = torch.where(first, gate_a, -torch.inf)
            kv = torch.cat([kv_a, kv[..., dim:]], dim=1)
            gate = torch.cat([gate_a, gate[..., dim:]], dim=1)
        weights = gate.softmax(dim=1).to(kv.dtype)
        entries = self.kv_norm((kv * weights).sum(dim=1))
        cos, sin = self.rope.tables(windows * rate)
        return rotate(entries, cos, sin)
