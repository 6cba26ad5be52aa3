"""DeepSeek-V4's attention: shared-KV multi-query attention over a sliding window plus, in
CSA and HCA layers, compressed entries of the whole context.

Queries come through a low-rank path (``q_a_proj``, ``q_a_norm``, ``q_b_proj``, then an
unweighted RMSNorm per head); one key per token (``kv_proj``, ``kv_norm``) is both key and
value for every head. Both are rotated on their last ``rope_dim`` values (interleaved pairs);
the values' rotation is undone on the output at the query's position. A query sees its last
``window`` positions, the compressed entries whose windows closed at or before it (a CSA
layer only those its lightning indexer picks), and a learned per-head sink that takes a share
of the softmax without a value. The heads' outputs go out in ``o_groups`` groups, each
through its own low-rank block (``o_a_proj``), then mixed by ``o_b_proj``.

The cache (until the engine keeps kinds of cache apart) holds one row per token and layer
(``RowLayout``): the token's key, and for a compressed layer its compressor's projections and,
at the token that closes a window, that window's entry (for CSA also the indexer's). Every
step writes its tokens' rows, pools the windows its tokens close, then attends: the torch
reference below, a query (or a prefill chunk) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionMetadata, gather_context
from splitserve.engine.layers.hyper_connections import unweighted_rms_norm
from splitserve.engine.layers.interleaved_rope import InterleavedRope, rotate
from splitserve.engine.layers.lightning_indexer import LightningIndexer
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.v4_compressor import Compressor
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.v4_config import V4Config


@dataclass(frozen=True)
class RowLayout:
    """Where a layer's values sit in a token's cache row: key | compressor rows | entry |
    indexer rows | indexer key (the last four only in the layers that have them)."""

    key: int
    compressor: int = 0
    entry: int = 0
    indexer: int = 0
    index_key: int = 0

    @classmethod
    def of(cls, v4: V4Config, kind: str) -> RowLayout:
        dim, index = v4.head_dim, v4.index_head_dim
        if kind == "sliding":
            return cls(dim)
        if kind == "hca":
            return cls(dim, 2 * dim, dim)
        return cls(dim, 4 * dim, dim, 4 * index, index)

    def bounds(self) -> list[int]:
        sizes = [self.key, self.compressor, self.entry, self.indexer, self.index_key]
        return [sum(sizes[:i]) for i in range(len(sizes) + 1)]

    def part(self, index: int) -> slice:
        """0 key, 1 compressor rows, 2 entry, 3 indexer rows, 4 indexer key."""
        bounds = self.bounds()
        return slice(bounds[index], bounds[index + 1])

    @property
    def width(self) -> int:
        return self.bounds()[-1]


class GroupedProjection(nn.Module):
    """o_a_proj: weight [groups * rank, in]; group g's inputs [in] go out through rows
    [g * rank, (g + 1) * rank). Not an ``nn.Linear``: no CPU weight format replaces it."""

    def __init__(self, in_features: int, groups: int, rank: int) -> None:
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(groups * rank, in_features))
        nn.init.uniform_(self.weight, -(in_features**-0.5), in_features**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, groups, in] -> [T, groups * rank]."""
        weight = self.weight.view(self.groups, -1, x.shape[-1])
        return torch.bmm(x.transpose(0, 1), weight.transpose(1, 2)).transpose(0, 1).flatten(1)


@dataclass(frozen=True)
class QueryGroup:
    """Consecutive query rows of one sequence, the last at position context_len - 1."""

    rows: slice
    block_table: torch.Tensor
    context_len: int


def query_groups(meta: AttentionMetadata) -> list[QueryGroup]:
    """Each decode row alone, then each prefill chunk."""
    lens = meta.decode_context_lens.tolist()
    groups = [
        QueryGroup(slice(i, i + 1), meta.decode_block_tables[i], length)
        for i, length in enumerate(lens)
    ]
    groups += [
        QueryGroup(slice(s.start, s.start + s.length), s.block_table, s.context_len)
        for s in meta.prefills
    ]
    return groups


class V4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, kind: str) -> None:
        super().__init__()
        v4 = cfg.v4
        assert v4 is not None
        self.kind, self.window, self.eps = kind, v4.window, cfg.rms_norm_eps
        self.heads, self.dim = cfg.num_heads, v4.head_dim
        hidden = cfg.hidden_size
        self.q_a_proj = nn.Linear(hidden, v4.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(v4.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(v4.q_lora_rank, self.heads * self.dim, bias=False)
        self.kv_proj = nn.Linear(hidden, self.dim, bias=False)
        self.kv_norm = RMSNorm(self.dim, cfg.rms_norm_eps)
        per_group = self.heads * self.dim // v4.o_groups
        self.o_a_proj = GroupedProjection(per_group, v4.o_groups, v4.o_lora_rank)
        self.o_b_proj = nn.Linear(v4.o_groups * v4.o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.heads, dtype=torch.float32))
        self.rope = InterleavedRope(v4.rope(kind), v4.rope_dim)
        self.rate = v4.rate(kind)
        self.compressor: Compressor | None = None
        self.indexer: LightningIndexer | None = None
        if kind != "sliding":
            self.compressor = Compressor(
                hidden, self.dim, self.rate, kind == "csa", self.rope, cfg.rms_norm_eps
            )
        if kind == "csa":
            self.indexer = LightningIndexer(hidden, v4, self.rope, cfg.rms_norm_eps)
        self.layout = RowLayout.of(v4, kind)
        self.cache = torch.empty(0)
        """[num_blocks, block_size, 1, row width of the widest layer], bound by the runner."""

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """Normed hidden states [T, H] -> the attention's output [T, H]."""
        tokens = x.shape[0]
        q_residual = self.q_a_norm(dense(x, self.q_a_proj))
        q = dense(q_residual, self.q_b_proj).view(tokens, self.heads, self.dim)
        cos, sin = self.rope.tables(positions)
        q = rotate(unweighted_rms_norm(q, self.eps), cos, sin)
        rows = [rotate(self.kv_norm(dense(x, self.kv_proj)), cos, sin)]
        if self.compressor is not None:
            rows += [self.compressor.project(x), x.new_zeros(tokens, self.layout.entry)]
        if self.indexer is not None:
            rows += [self.indexer.compressor.project(x), x.new_zeros(tokens, self.indexer.dim)]
        flat = self.cache.view(-1, self.cache.shape[-1])[:, : self.layout.width]
        flat.index_copy_(0, meta.slot_mapping, torch.cat(rows, dim=-1))
        out = torch.empty_like(q)
        for group in query_groups(meta):
            r = group.rows
            slots = meta.slot_mapping[r]
            out[r] = self.attend(q[r], x[r], q_residual[r], positions[r], slots, group)
        out = rotate(out, cos, -sin)
        grouped = self.o_a_proj(out.view(tokens, self.o_a_proj.groups, -1))
        return dense(grouped, self.o_b_proj)

    def attend(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        group: QueryGroup,
    ) -> torch.Tensor:
        """One group's queries [L, heads, dim] over its window and compressed entries."""
        context = group.context_len
        rows = gather_context(self.cache, group.block_table[None, :])[0, :context, 0]
        first = max(0, context - q.shape[0] - self.window + 1)
        keys = rows[first:, self.layout.part(0)]
        key_positions = torch.arange(first, context, device=q.device)
        ahead = key_positions[None, :] - positions[:, None]
        mask = (ahead <= 0) & (ahead > -self.window)
        if self.compressor is not None:
            entries = self.entries(self.compressor, rows, slots, context, 2)
            seen = ((positions + 1) // self.rate)[:, None]
            visible = torch.arange(entries.shape[0], device=q.device)[None, :] < seen
            if self.indexer is not None:
                index_keys = self.entries(self.indexer.compressor, rows, slots, context, 4)
                visible = self.indexer.select(x, q_residual, positions, index_keys)
            keys = torch.cat([keys, entries])
            mask = torch.cat([mask, visible], dim=1)
        return self.attention(q, keys, mask)

    def entries(
        self,
        compressor: Compressor,
        rows: torch.Tensor,
        slots: torch.Tensor,
        context: int,
        part: int,
    ) -> torch.Tensor:
        """The context's compressed entries [context // rate, dim] of ``compressor`` (its
        rows at part - 1, its entries at ``part``): the windows closed by this group's
        tokens are pooled and written to the cache first."""
        rate, start = compressor.rate, context - slots.shape[0]
        windows = torch.arange(start // rate, context // rate, device=rows.device)
        where = self.layout.part(part)
        if windows.numel():
            pooled = compressor.pool(rows[:, self.layout.part(part - 1)], windows)
            closing = (windows + 1) * rate - 1
            rows[closing, where] = pooled
            flat = self.cache.view(-1, self.cache.shape[-1])
            flat[slots[closing - start], where] = pooled
        return rows[rate - 1 :: rate, where][: context // rate]

    def attention(self, q: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """q [L, heads, dim] over keys (also the values) [K, dim] where mask [L, K], with
        each head's sink in the softmax, in float32."""
        scores = torch.einsum("lhd,kd->hlk", q.float(), keys.float()) * self.dim**-0.5
        scores = scores.masked_fill(~mask[None], -torch.inf)
        sink = self.sinks.float()[:, None, None].expand(-1, q.shape[0], 1)
        logits = torch.cat([scores, sink], dim=-1)
        probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
        return torch.einsum("hlk,kd->lhd", probs, keys.float()).to(q.dtype)
