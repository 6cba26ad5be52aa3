"""Attention backend on the Triton kernels of ``splitserve.kernels``.

Rotary fused with the K/V write, paged decode attention and varlen paged prefill attention each
run as one launch for the whole step; a step of decode tokens only runs all three as one launch
(``paged_decode_attention_qkv``). The prefill kernel takes the step's prefill segments as
tensors (row starts, lengths, context lengths, a padded block table); they are built once per
step, on the first layer that sees the metadata, and reused by the other layers.

Over an FP8 cache (``layers/fp8_kv.py``) the rotary and K/V write launch quantizes each row
as it writes it and the attention kernels dequantize the rows they load; decode steps take
two launches there (the fused one's write does not quantize).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata, write_kv
from splitserve.engine.layers.fp8_kv import is_fp8_cache
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_qkv,
)
from splitserve.kernels.kv_write import write_kv_cache
from splitserve.kernels.prefill_attention import paged_prefill_attention
from splitserve.kernels.rotary import rotary_kv_write


@dataclass(frozen=True)
class PrefillBatch:
    """The prefill segments of one step as kernel arguments."""

    q_starts: torch.Tensor
    q_lens: torch.Tensor
    context_lens: torch.Tensor
    block_tables: torch.Tensor
    max_q_len: int

    @staticmethod
    def from_metadata(meta: AttentionMetadata, device: torch.device) -> PrefillBatch:
        segs = meta.prefills
        starts, lengths, contexts = torch.tensor(
            [[s.start for s in segs], [s.length for s in segs], [s.context_len for s in segs]],
            dtype=torch.long,
        ).to(device, non_blocking=True)
        tables = pad_sequence([s.block_table.to(device) for s in segs], batch_first=True)
        return PrefillBatch(
            q_starts=starts,
            q_lens=lengths,
            context_lens=contexts,
            block_tables=tables.contiguous(),
            max_q_len=max(s.length for s in segs),
        )


class TritonAttention(AttentionBackend):
    """Triton kernels for the K/V write, decode and prefill; CUDA, or CPU under the interpreter."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._meta: AttentionMetadata | None = None
        self._prefill: PrefillBatch | None = None

    def configured(self, scale: float | None, sliding_window: int | None) -> AttentionBackend:
        if sliding_window is not None:
            raise ValueError(
                "the triton attention backend has no sliding window yet: serve this model "
                "with attention_backend: torch"
            )
        return super().configured(scale, sliding_window)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        if is_fp8_cache(k_cache):
            write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q.contiguous(), k_cache, v_cache, meta)

    def forward_qkv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Rotary and the K/V write in one launch, then attention over the cache; all three in
        one launch when every token of the step is a decode token of its own sequence (not a
        verify step, whose rows read each other's K/V)."""
        decode_only = not meta.prefills and meta.num_decode_tokens == qkv.shape[0]
        # The fused launch's write does not quantize: an FP8 cache takes two launches.
        if decode_only and not meta.verify and not is_fp8_cache(k_cache):
            return paged_decode_attention_qkv(
                qkv, self.num_heads, positions, rotary.cos, rotary.sin, meta.slot_mapping,
                k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens,
                self.scale,
            )  # fmt: skip
        q = rotary_kv_write(
            positions, qkv, self.num_heads, rotary.cos, rotary.sin, k_cache, v_cache,
            meta.slot_mapping,
        )  # fmt: skip
        return self._attend(q, k_cache, v_cache, meta)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            paged_decode_attention(
                q[:n],
                k_cache,
                v_cache,
                meta.decode_block_tables,
                meta.decode_context_lens,
                self.scale,
                out=out[:n],
            )
        if meta.prefills:
            batch = self._prefill_batch(meta, q.device)
            paged_prefill_attention(
                q,
                k_cache,
                v_cache,
                batch.block_tables,
                batch.q_starts,
                batch.q_lens,
                batch.context_lens,
                batch.max_q_len,
                self.scale,
                out=out,
            )
        return out

    def _prefill_batch(self, meta: AttentionMetadata, device: torch.device) -> PrefillBatch:
        # NOTE: every layer of a step gets the same metadata object, so identity is the key.
        if self._meta is not meta or self._prefill is None:
            self._prefill = PrefillBatch.from_metadata(meta, device)
            self._meta = meta
        return self._prefill
