"""Manifold-constrained hyper-connections (DeepSeek-V4): the residual as ``n`` streams.

Before each block (attention, MLP) one projection of the RMS-normed streams [T, n * H]
gives three sets of weights per token: ``pre`` [n] collapses the streams into the block's
input, ``post`` [n] spreads the block's output over the streams, and ``comb`` [n, n], made
close to doubly stochastic by Sinkhorn's alternate normalizations, mixes the old streams into
the new: stream k becomes post[k] * out + sum_j comb[j, k] * stream j. The head collapses the
streams once more with weights of its own. Everything here runs in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """The weights of one block's connections: ``fn`` [(2 + n) * n, n * H], ``base``
    [(2 + n) * n] and ``scale`` [3] (pre, post, comb)."""

    def __init__(
        self, hidden_size: int, streams: int, iters: int, eps: float, norm_eps: float
    ) -> None:
        super().__init__()
        self.streams, self.iters, self.eps, self.norm_eps = streams, iters, eps, norm_eps
        mix = (2 + streams) * streams
        self.fn = nn.Parameter(torch.empty(mix, streams * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        nn.init.normal_(self.fn, std=0.02)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], the block's input [T, H])."""
        n = self.streams
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn)
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre = torch.sigmoid(pre_w * self.scale[0] + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * self.scale[1] + post_b)
        logits = comb_w.view(-1, n, n) * self.scale[2] + comb_b.view(n, n)
        comb = sinkhorn(torch.softmax(logits, dim=-1) + self.eps, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def sinkhorn(comb: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns normalized, then ``iters - 1`` rounds of rows then columns."""
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb


def spread(
    streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The new streams [T, n, H]: post[k] * out + sum_j comb[j, k] * streams[j]."""
    dtype = streams.dtype
    mixed = torch.matmul(comb.to(dtype).transpose(-1, -2), streams)
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + mixed


class HyperHead(nn.Module):
    """The last collapse of the streams before the final norm: ``hc_fn`` [n, n * H],
    ``hc_base`` [n], ``hc_scale`` [1]."""

    def __init__(self, hidden_size: int, streams: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.empty(streams, streams * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(streams, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        nn.init.normal_(self.hc_fn, std=0.02)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = torch.sigmoid(F.linear(flat, self.hc_fn) * self.hc_scale + self.hc_base) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
