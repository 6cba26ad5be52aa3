"""Paged attention behind a small backend interface.

A step's tokens are laid out flat: first the decode rows (one token each), then the new tokens
of each prefilling sequence. Every backend writes the step's K/V into the paged cache at
``slot_mapping`` and attends over each sequence's cached context.

A verify step (speculative decoding) lays a sequence's last token and its drafts out as
decode rows of their own, each with its position's context length: the step is then a decode
step (the decode kernels and CUDA graphs), and every row's K/V is in the cache before any row
attends (``AttentionMetadata.verify``).
"""

from __future__ import annotations

import copy
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from splitserve.engine.layers.fp8_kv import is_fp8_cache, pack_kv, rounded_kv, unpack_kv
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels.native import decode as native


@dataclass
class PrefillSegment:
    """New tokens [start, start + length) of one sequence whose context ends at context_len."""

    start: int
    length: int
    context_len: int
    block_table: torch.Tensor


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor
    num_decode_tokens: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefills: list[PrefillSegment]
    verify: bool = False
    """Some decode rows are draft positions of one sequence, which attend to each other's K/V:
    the step writes every row's K/V before any row attends (no fused write-and-attend)."""
    windows: list[AttentionMetadata] = field(default_factory=list)
    """The same rows in each sliding-window KV cache group (engine/kv_groups.py): the
    metadata of group g is ``windows[g - 1]``."""

    def group(self, index: int) -> AttentionMetadata:
        """The metadata of KV cache group ``index`` (0: this)."""
        return self if index == 0 else self.windows[index - 1]


class AttentionBackend(ABC):
    """Computes attention for one layer over the paged KV cache.

    k_cache / v_cache: [num_blocks, block_size, num_kv_heads, head_dim].
    q: [T, num_heads, head_dim]; k, v: [T, num_kv_heads, head_dim]; returns [T, H, D].
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.sliding_window: int | None = None
        """Each query attends to its last ``sliding_window`` positions, itself included
        (None: to its whole context)."""

    def configured(self, scale: float | None, sliding_window: int | None) -> AttentionBackend:
        """A copy of this backend with another softmax scale (None: this one's) and window,
        for the layers that differ (Gemma 3's local layers, its query_pre_attn_scalar)."""
        other = copy.copy(self)
        other.scale = self.scale if scale is None else scale
        other.sliding_window = sliding_window
        return other

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention from the fused projection qkv [T, (H + 2 * Hkv) * D] before rotary."""
        q, k, v = self.rotated_qkv(qkv, positions, rotary)
        return self.forward(q, k, v, k_cache, v_cache, meta)

    def rotated_qkv(
        self, qkv: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """qkv [T, (H + 2 * Hkv) * D] -> q [T, H, D] and k [T, Hkv, D] rotated, v [T, Hkv, D]."""
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(positions, q, k)
        return q, k, v


class TorchAttention(AttentionBackend):
    """Pure-torch reference backend; runs on CPU and CUDA. On the CPU in float32 its decode
    rows take the native kernel (rotary, K/V write and attention in one call per layer,
    ``kernels/native/decode.c``) where it is built."""

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        n = meta.num_decode_tokens
        native_cache = k_cache.is_contiguous() and k_cache.dtype == qkv.dtype
        if not (n and native.use_native(qkv) and native_cache):
            return super().forward_qkv(qkv, positions, rotary, k_cache, v_cache, meta)
        out = qkv.new_empty(qkv.shape[0], self.num_heads, self.head_dim)
        native.decode_attention(
            qkv[:n], positions[:n], rotary.cos, rotary.sin, k_cache, v_cache,
            meta.slot_mapping[:n], meta.decode_block_tables, meta.decode_context_lens,
            self.num_heads, self.scale, out[:n], self.sliding_window,
        )  # fmt: skip
        if qkv.shape[0] > n:
            q, k, v = self.rotated_qkv(qkv[n:], positions[n:], rotary)
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping[n:])
            for seg in meta.prefills:
                rows = slice(seg.start - n, seg.start - n + seg.length)
                out[seg.start : seg.start + seg.length] = self._prefill(
                    q[rows], k[rows], v[rows], k_cache, v_cache, seg
                )
        return out

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if is_fp8_cache(k_cache):  # a chunk sees its own K/V as the cache gives them back
            k, v = rounded_kv(k), rounded_kv(v)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = self._prefill(q[rows], k[rows], v[rows], k_cache, v_cache, seg)
        return out

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        batch = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys = read_context(k_cache, meta.decode_block_tables, q.dtype)
        values = read_context(v_cache, meta.decode_block_tables, q.dtype)
        length = keys.shape[1]
        index = torch.arange(length, device=q.device)[None, :]
        lens = meta.decode_context_lens[:, None]
        mask = index < lens
        if self.sliding_window is not None:
            mask &= index >= lens - self.sliding_window
        # The query heads of one KV group act as that group's "query positions".
        grouped = q.view(batch, self.num_kv_heads, group, self.head_dim)
        out = F.scaled_dot_product_attention(
            grouped,
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
        )
        return out.reshape(batch, self.num_heads, self.head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        cached = seg.context_len - seg.length
        if cached:
            table = seg.block_table[None, :]
            k = read_context(k_cache, table, q.dtype)[0, : seg.context_len]
            v = read_context(v_cache, table, q.dtype)[0, : seg.context_len]
        window = self.sliding_window
        if window is not None and seg.context_len <= window:
            window = None  # every query's window holds its whole context
        out = None
        if native.use_native(q) and window is None and native.prefill_pays():
            out = native.prefill_attention(q, k, v, self.scale)
        return out if out is not None else self._sdpa_prefill(q, k, v, window)

    def _sdpa_prefill(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None
    ) -> torch.Tensor:
        """torch's attention of a chunk's queries q [L, H, D] over their context's k, v
        [T, Hkv, D] (the chunk is the context's last L tokens)."""
        group = self.num_heads // self.num_kv_heads
        if q.device.type == "cpu" and group > 1:
            # torch's CPU flash kernel takes no grouped K/V (enable_gqa falls back to the math
            # path: SmolLM2's 256-token prompt 3.2 against 1.7 ms a layer on one Zen 5 thread).
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return chunk_attention(q, k, v, self.scale, window)


def chunk_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None
) -> torch.Tensor:
    """torch's causal attention of a chunk's queries q [L, H, D] over their context's
    k [T, Hkv, D] and v [T, Hkv, Dv], the chunk being the context's last L tokens
    -> [L, H, Dv]. window: each query sees only its last ``window`` positions."""
    length, context = q.shape[0], k.shape[0]
    mask = None
    if context > length or window is not None:
        positions = torch.arange(length, device=q.device)[:, None] + context - length
        keys = torch.arange(context, device=q.device)[None, :]
        mask = keys <= positions
        if window is not None:
            mask &= keys > positions - window
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store each new token's K/V at its slot (block * block_size + offset); an FP8 cache
    stores each row's e4m3 values and scale (``fp8_kv.py``; torch copies FP8 as bytes)."""
    heads, dim = k_cache.shape[2], k_cache.shape[3]
    if is_fp8_cache(k_cache):
        k, v = pack_kv(k).view(torch.uint8), pack_kv(v).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def read_context(
    cache: torch.Tensor, block_tables: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """``gather_context`` in dtype (an FP8 cache's rows dequantized)."""
    if not is_fp8_cache(cache):
        return gather_context(cache, block_tables)
    rows = gather_context(cache.view(torch.uint8), block_tables).view(cache.dtype)
    return unpack_kv(rows, dtype)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[B, max_blocks] block ids -> [B, max_blocks * block_size, heads, dim]."""
    batch, num_blocks = block_tables.shape
    _, block_size, heads, dim = cache.shape
    # index_select on the flat table copies ~2.5x faster than advanced indexing on CPU.
    blocks = cache.index_select(0, block_tables.reshape(-1))
    return blocks.view(batch, num_blocks * block_size, heads, dim)
