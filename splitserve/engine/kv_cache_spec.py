"""What one token leaves in the paged KV cache: the shape a model declares for its cache.

The model runner allocates one tensor ``[parts, layers, blocks, block_size, heads, head_dim]``
from the spec; the block manager, prefix cache, store and handoff move its blocks as opaque
slices of that tensor (``runner.kv_shape``), so they carry any kind unchanged in meaning.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """``parts``: 2 for K and V (full attention), 1 for one latent per token (MLA, whose
    ``heads`` is 1 and ``head_dim`` the latent and RoPE parts together). ``layers``: the
    cache layers, those of the decoder plus any the model keeps beside them."""

    parts: int
    layers: int
    heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.parts not in (1, 2):
            raise ValueError("a KV cache holds K and V (2 parts) or one latent (1)")

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        return (self.parts, self.layers, num_blocks, block_size, self.heads, self.head_dim)

    def values_per_token(self) -> int:
        """Values one token leaves in the cache, over every layer."""
        return self.parts * self.layers * self.heads * self.head_dim
