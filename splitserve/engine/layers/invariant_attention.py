"""Deterministic mode's attention backend on the Triton kernels (``batch_invariant_kernels.py``).

Every row of a step (decode, verify and prompt rows alike) takes the same two kernels: rotary
fused with the K/V write (``rotary_kv_write``, a row at a time), then, once the whole step's
K/V is in the cache, ``invariant_attention`` over the paged cache. A prompt's keys are read
back from the cache like a decode row's, so a row's sums are the same whether its prefix was
computed in this step, an earlier chunk, or came from the prefix cache. Not the fused
decode kernel of ``TritonAttention`` (its rotary is another kernel's arithmetic) nor the
decode kernel's batch-dependent KV split.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels.invariant_attention import invariant_attention, prefill_tiles
from splitserve.kernels.kv_write import write_kv_cache
from splitserve.kernels.rotary import rotary_kv_write


@dataclass(frozen=True)
class PromptTiles:
    """A step's prompt chunks as the kernel's arguments: its tiles and a block table a chunk."""

    tiles: tuple[torch.Tensor, ...]
    tables: torch.Tensor

    @staticmethod
    def from_metadata(meta: AttentionMetadata, group: int, device: torch.device) -> PromptTiles:
        segs = meta.prefills
        if not segs:  # decode steps (CUDA graphs): no copy from the host
            empty = torch.empty(4, 0, dtype=torch.int32, device=device)
            return PromptTiles(empty.unbind(0), torch.zeros(0, 1, dtype=torch.long, device=device))
        tiles = prefill_tiles([(s.start, s.length, s.context_len) for s in segs], group, device)
        tables = pad_sequence([s.block_table.to(device) for s in segs], batch_first=True)
        return PromptTiles(tiles, tables.contiguous())


class InvariantAttention(AttentionBackend):
    """Batch-invariant attention; CUDA, or CPU under the Triton interpreter."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim)
        self._meta: AttentionMetadata | None = None
        self._tiles: PromptTiles | None = None

    @staticmethod
    def replacing(backend: AttentionBackend) -> InvariantAttention:
        """This backend in place of ``backend`` (its heads and scale); ValueError for a sliding
        window, which the kernel has not."""
        if backend.sliding_window is not None:
            raise ValueError("deterministic mode on the GPU has no sliding-window attention yet")
        other = InvariantAttention(backend.num_heads, backend.num_kv_heads, backend.head_dim)
        other.scale = backend.scale
        return other

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
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
        q = rotary_kv_write(
            positions, qkv, self.num_heads, rotary.cos, rotary.sin, k_cache, v_cache,
            meta.slot_mapping,
        )  # fmt: skip
        return self._attend(q, k_cache, v_cache, meta)

    def _attend(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        prompt = self._prompt_tiles(meta, q.device)
        tables = meta.decode_block_tables
        if tables.dim() == 1:  # no decode rows: an empty list of tables
            tables = tables.view(0, 1)
        return invariant_attention(
            q, k_cache, v_cache, tables, meta.decode_context_lens, prompt.tiles, prompt.tables,
            self.scale,
        )  # fmt: skip

    def _prompt_tiles(self, meta: AttentionMetadata, device: torch.device) -> PromptTiles:
        # NOTE: every layer of a step gets the same metadata object, so identity is the key.
        if self._meta is not meta or self._tiles is None:
            group = self.num_heads // self.num_kv_heads
            self._tiles = PromptTiles.from_metadata(meta, group, device)
            self._meta = meta
        return self._tiles
