"""What one token leaves in the paged KV cache: the shape a model declares for its cache.

The model runner allocates one tensor ``[parts, layers, blocks, block_size, heads, head_dim]``
per KV cache group from its spec; the block manager, prefix cache, store and handoff move the
blocks of group 0 as opaque slices of that tensor (``runner.kv_shape``), so they carry any
kind unchanged in meaning.

A model whose layers attend differently declares one group per kind (``KVCacheGroup``):
group 0 holds the layers that see the whole context, and is what prefix caching hashes,
stores and shares; each further group holds sliding-window layers, with a block table of its
own per request from which the blocks behind the window are freed while the request runs
(``engine/hybrid_blocks.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """``parts``: 2 for K and V (full attention), 1 for one latent per token (MLA, whose
    ``heads`` is 1 and ``head_dim`` the latent and RoPE parts together). ``layers``: the
    cache layers, those of the decoder plus any the model keeps beside them.
    ``entry_tokens``: the tokens whose slots are written together, when the last of them is
    computed (DeepSeek-V4 spreads a compressed entry of 128 tokens over their slots): a
    block's values are final, so that it can be hashed and reused, only at multiples of it."""

    parts: int
    layers: int
    heads: int
    head_dim: int
    entry_tokens: int = 1
    scale_values: int = 0
    """Slots after each row's head_dim values that hold its scale (an FP8 cache's 16: the
    float32 scale's 4 bytes and 12 that keep rows 16-byte aligned, ``layers/fp8_kv.py``)."""

    def __post_init__(self) -> None:
        if self.parts not in (1, 2):
            raise ValueError("a KV cache holds K and V (2 parts) or one latent (1)")
        if self.entry_tokens < 1:
            raise ValueError("an entry covers at least one token")

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int, int, int]:
        width = self.head_dim + self.scale_values
        return (self.parts, self.layers, num_blocks, block_size, self.heads, width)

    def values_per_token(self) -> int:
        """Values one token leaves in the cache, over every layer (scales included)."""
        return self.parts * self.layers * self.heads * (self.head_dim + self.scale_values)


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table. ``layers``: the decoder layers whose attention
    reads this group's tensor, in the order of its layer axis, or all from its one cache
    layer (a spec of one layer whose row packs rows of different widths: DeepSeek-V4's
    compressed entries, ``layers/v4_cache.py``). ``window``: each query sees
    its last ``window`` positions (None: the whole context; group 0 is always None)."""

    spec: KVCacheSpec
    layers: tuple[int, ...]
    window: int | None = None

    def __post_init__(self) -> None:
        if len(self.layers) != self.spec.layers and self.spec.layers != 1:
            raise ValueError("a KV cache group's spec counts its layers")
        if self.window is not None and self.window < 1:
            raise ValueError("a sliding window holds at least one position")
