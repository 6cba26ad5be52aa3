"""DeepSeek-V4's lightning indexer: which compressed entries a CSA query attends to.

The indexer compresses the context as CSA does (``Compressor`` with overlapping windows, at
``index_head_dim``) into keys; a query's ``index_heads`` heads come from the attention's
low-rank query (``q_b_proj``), rotated at the query's position, and its score of key s is
sum_h w_h * relu(q_h . k_s) / sqrt(index_head_dim), the head weights w projected from the
hidden states and scaled by 1 / sqrt(index_heads). A query keeps the ``index_topk`` best
of the entries it may see (those whose windows end at or before it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.interleaved_rope import InterleavedRope, rotate
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.v4_compressor import Compressor
from splitserve.engine.layers.v4_decode import score_rows
from splitserve.engine.v4_config import V4Config


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, v4: V4Config, rope: InterleavedRope, eps: float) -> None:
        super().__init__()
        self.heads, self.dim, self.topk = v4.index_heads, v4.index_head_dim, v4.index_topk
        self.rate = v4.csa_rate
        self.compressor = Compressor(hidden_size, self.dim, self.rate, True, rope, eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, self.heads, bias=False)
        self.rope = rope

    def queries(
        self, x: torch.Tensor, q_residual: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The index queries [L, heads, dim] (rotated) and head weights [L, heads] (float32)
        of L queries (hidden states x, low-rank queries q_residual, positions)."""
        q = dense(q_residual, self.q_b_proj).view(x.shape[0], self.heads, self.dim)
        q = rotate(q, *self.rope.tables(positions))
        return q, dense(x, self.weights_proj).float() * self.heads**-0.5


def index_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """[L, n] float32: sum_h w_h relu(q_h . k) / sqrt(dim) of queries q [L, heads, dim], head
    weights [L, heads] and keys [n, dim]; in passes of rows within SCORE_BYTES."""
    rows = score_rows(q.shape[1] * keys.shape[0])
    if q.shape[0] > rows:
        passes = range(0, q.shape[0], rows)
        return torch.cat(
            [index_scores(q[i : i + rows], weights[i : i + rows], keys) for i in passes]
        )
    scores = F.relu(torch.einsum("lhd,nd->lhn", q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (scores * weights.unsqueeze(-1)).sum(dim=1)


def choose(score: torch.Tensor, seen: torch.Tensor, topk: int) -> torch.Tensor:
    """[L, n] bool: of scores [L, n], each query's ``topk`` best (by ``torch.topk``) of its
    first ``seen`` [L] entries, or all of them where the context has no more than topk."""
    visible = torch.arange(score.shape[1], device=score.device)[None, :] < seen[:, None]
    if score.shape[1] <= topk:
        return visible
    best = score.masked_fill(~visible, -torch.inf).topk(topk, dim=-1).indices
    return torch.zeros_like(visible).scatter_(1, best, True) & visible
