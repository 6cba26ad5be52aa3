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

The cache (``layers/v4_cache.py``): a token's key and compressor projections (its state row)
in sliding-window groups, the compressed entries in pieces in group 0. Every step writes its
tokens' keys and state rows, pools the windows its tokens close into group 0 (except where a
prefix hit's replay recomputes positions whose entries came from the cache), then attends:
in torch a decode row or a prefill chunk at a time (``layers/v4_prefill.py``: blocks of the
window's width, each row's chosen entries gathered); on the "triton" backend the CUDA decode
rows take the kernels in one batch, and the prefill rows of a layer without an indexer the
decode kernel, each a decode row over its own context (``layers/v4_decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionMetadata
from splitserve.engine.layers.hyper_connections import unweighted_rms_norm
from splitserve.engine.layers.interleaved_rope import InterleavedRope, rotate
from splitserve.engine.layers.lightning_indexer import LightningIndexer
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.v4_cache import LayerCache
from splitserve.engine.layers.v4_compressor import Compressor
from splitserve.engine.layers.v4_decode import (
    closing_windows,
    decode_kernels,
    held_entries,
    prefill_kernels,
)
from splitserve.engine.layers.v4_prefill import Entries, Indexer, prefill_attention
from splitserve.engine.model_config import ModelConfig
from splitserve.kernels.dispatch import use_kernels


@dataclass(frozen=True)
class CacheSlice:
    """A layer of KV cache group ``group``'s tensor, [blocks, block_size, 1, width], whose
    columns from ``column`` on hold one part of a V4 layer's cache."""

    layer: torch.Tensor
    group: int
    column: int = 0


def _columns(part: CacheSlice, width: int) -> torch.Tensor:
    return part.layer[:, :, 0, part.column : part.column + width]


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


def query_groups(meta: AttentionMetadata, decodes: bool = True) -> list[QueryGroup]:
    """Each decode row alone (unless not ``decodes``: their lengths stay on the device),
    then each prefill chunk."""
    groups = []
    if decodes and meta.num_decode_tokens:
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
    def __init__(self, cfg: ModelConfig, kind: str, kernel: bool = False) -> None:
        super().__init__()
        self.kernel = kernel
        """The "triton" attention backend: CUDA decode rows take ``layers/v4_decode.py``'s
        kernels."""
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
        self.layout = LayerCache.of(v4, kind)
        self.key_cache = torch.empty(0)
        """[num_blocks, block_size, head_dim]: the keys (bound by ``bind``)."""
        self.state_cache = torch.empty(0)
        """[num_blocks, block_size, state_width]: the compressors' projections."""
        self.entry_cache = torch.empty(0)
        """[num_blocks, block_size, piece]: this layer's entry pieces in group 0."""
        self.groups = (0, 0)
        """The KV cache groups of the keys and of the state rows."""

    def bind(self, keys: CacheSlice, state: CacheSlice, entries: CacheSlice) -> None:
        """Where this layer's keys, state rows and entry pieces are: each a column range of
        a KV cache group's layer (the entries' in group 0; with one group, all three in
        the same tensor)."""
        layout = self.layout
        self.key_cache = _columns(keys, layout.key)
        self.state_cache = _columns(state, layout.state_width)
        self.entry_cache = _columns(entries, layout.piece)
        self.groups = (keys.group, state.group)

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
            rows.append(self.compressor.project(x))
        if self.indexer is not None:
            rows.append(self.indexer.compressor.project(x))
        key_meta, state_meta = meta.group(self.groups[0]), meta.group(self.groups[1])
        self.key_cache.flatten(0, 1).index_copy_(0, key_meta.slot_mapping, rows[0])
        if len(rows) > 1:
            state = torch.cat(rows[1:], dim=-1)
            self.state_cache.flatten(0, 1).index_copy_(0, state_meta.slot_mapping, state)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        kernels = self.kernel and use_kernels(q)
        if kernels and n:  # the decode rows in one batch, their lengths read on the device only
            if self.compressor is not None:
                self.pool_decodes(meta, state_meta)
            out[:n] = self.decode(q[:n], x[:n], q_residual[:n], positions[:n], meta)
        # a CSA chunk stays in torch: on the H200 the indexer's kernel, its choice and the
        # attention's split partials at 8k rows took longer than the blocked path
        attend = self.attend_on_kernel if kernels and self.indexer is None else self.attend
        groups = (query_groups(m, not kernels) for m in (key_meta, state_meta, meta))
        for near, pooled, whole in zip(*groups):
            r = whole.rows
            slots = meta.slot_mapping[r]
            views = (near, pooled, whole)
            out[r] = attend(q[r], x[r], q_residual[r], positions[r], slots, views)
        out = rotate(out, cos, -sin)
        grouped = self.o_a_proj(out.view(tokens, self.o_a_proj.groups, -1))
        return dense(grouped, self.o_b_proj)

    def decode(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The step's decode rows [n, heads, dim] through the kernels (the windows they
        close pooled already)."""
        entries = index = None
        if self.compressor is not None:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
            entries = (self.entry_cache, tables, lens, self.rate)
        if self.indexer is not None:
            index = (*self.indexer.queries(x, q_residual, positions), self.dim, self.indexer.topk)
        key_meta = meta.group(self.groups[0])
        keys = (key_meta.decode_block_tables, key_meta.decode_context_lens)
        return decode_kernels(q, self.key_cache, keys, self.sinks, self.window, entries, index)

    def attend_on_kernel(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        views: tuple[QueryGroup, QueryGroup, QueryGroup],
    ) -> torch.Tensor:
        """``attend`` on the kernel (a layer without an indexer): the windows the group's
        tokens close pooled, then each row a decode row over its own context (its key table's
        rows and the entries up to its position)."""
        near, pooled, whole = views
        if self.compressor is not None:
            self.pool(pooled, slots, whole)
        rows = q.shape[0]
        behind = torch.arange(rows - 1, -1, -1, device=q.device)  # rows after each one
        keys = (near.block_table.expand(rows, -1), near.context_len - behind)
        entries = None
        if self.compressor is not None:
            tables = whole.block_table.expand(rows, -1)
            entries = (self.entry_cache, tables, whole.context_len - behind, self.rate)
        return prefill_kernels(q, self.key_cache, keys, self.sinks, self.window, entries)

    def attend(
        self,
        q: torch.Tensor,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        views: tuple[QueryGroup, QueryGroup, QueryGroup],
    ) -> torch.Tensor:
        """One group's queries [L, heads, dim] over its window (the keys, by its key group's
        table) and compressed entries (pooled from the state group's rows, read by group
        0's table)."""
        near, pooled, whole = views
        end = whole.context_len
        base = end - near.context_len  # the position of the key table's first row
        rows = self.key_cache[near.block_table].flatten(0, 1)[: near.context_len]
        first = max(base, end - q.shape[0] - self.window + 1)
        entries = None
        if self.compressor is not None:
            held = self.entries(pooled, slots, whole)
            indexer = None
            if self.indexer is not None:
                index_q, weights = self.indexer.queries(x, q_residual, positions)
                indexer = Indexer(index_q, weights, held[:, self.dim :], self.indexer.topk)
            entries = Entries(held[:, : self.dim], self.rate, indexer)
        start = end - q.shape[0]
        return prefill_attention(q, rows[first - base :], start, self.sinks, self.window, entries)

    def entries(self, pooled: QueryGroup, slots: torch.Tensor, whole: QueryGroup) -> torch.Tensor:
        """The context's compressed entries [context // rate, entry | index key], after
        ``pool``."""
        self.pool(pooled, slots, whole)
        return held_entries(
            self.entry_cache, whole.block_table, whole.context_len // self.rate, self.rate
        )

    def pool(self, pooled: QueryGroup, slots: torch.Tensor, whole: QueryGroup) -> None:
        """The entries of the windows this group's tokens close, pooled from the state rows
        and written to group 0; a window whose closing token's group-0 slot is the scratch
        block (a replay of a cached prefix, whose entries are in the cache) writes to the
        scratch block instead (no host read)."""
        rate, end = self.rate, whole.context_len
        start = end - slots.shape[0]
        if end // rate == start // rate:
            return
        windows = torch.arange(start // rate, end // rate, device=slots.device)
        block_size = self.entry_cache.shape[1]
        scratch = self.entry_cache.shape[0] - 1
        replayed = slots[(windows + 1) * rate - 1 - start] // block_size == scratch
        state = self.state_cache[pooled.block_table].flatten(0, 1)[: pooled.context_len]
        base = end - pooled.context_len
        offsets = torch.arange(rate - self.layout.reach, rate, device=slots.device)
        rows = state[(windows[:, None] * rate + offsets - base).clamp(min=0)]
        where = windows[:, None] * rate + torch.arange(rate, device=slots.device)
        blocks = torch.where(replayed[:, None], scratch, whole.block_table[where // block_size])
        flat = self.entry_cache.flatten(0, 1)
        flat[(blocks * block_size + where % block_size).flatten()] = self.pieces(rows, windows)

    def pool_decodes(self, meta: AttentionMetadata, state_meta: AttentionMetadata) -> None:
        """``pool`` for the step's decode rows at once, in fixed shapes: every row pools the
        window its position would close; a row that closes none, or whose group-0 slot is
        the scratch block, writes its entry to the scratch block."""
        n, rate = meta.num_decode_tokens, self.rate
        lens = meta.decode_context_lens[:n]
        windows, rows = closing_windows(self.state_cache, state_meta, lens, rate, self.layout.reach)
        block_size = self.entry_cache.shape[1]
        scratch = self.entry_cache.shape[0] - 1
        closes = (lens % rate == 0) & (meta.slot_mapping[:n] // block_size != scratch)
        tables = meta.decode_block_tables[:n]
        where = windows[:, None] * rate + torch.arange(rate, device=lens.device)
        blocks = tables.gather(1, (where // block_size).clamp(max=tables.shape[1] - 1))
        blocks = torch.where(closes[:, None], blocks, scratch)
        flat = self.entry_cache.flatten(0, 1)
        flat[(blocks * block_size + where % block_size).flatten()] = self.pieces(rows, windows)

    def pieces(self, rows: torch.Tensor, windows: torch.Tensor) -> torch.Tensor:
        """The pieces [n * rate, piece] of ``windows`` [n]'s entries (and index keys), pooled
        from each one's state rows [n, reach, state_width]."""
        assert self.compressor is not None
        parts = [self.compressor.pool_windows(rows[..., self.layout.state_part(0)], windows)]
        if self.indexer is not None:
            part = self.layout.state_part(1)
            parts.append(self.indexer.compressor.pool_windows(rows[..., part], windows))
        return torch.cat(parts, dim=-1).view(-1, self.layout.piece)
