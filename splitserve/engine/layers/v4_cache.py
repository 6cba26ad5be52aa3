"""What DeepSeek-V4 keeps in its KV cache, per layer and token, and how that splits into KV
cache groups (``kv_cache_spec.KVCacheGroup``).

Each layer keeps, a token:

- its **key**, which the queries of the next ``window`` positions read: every layer's keys
  are one sliding-window group, whose blocks go back to the pool behind the window.
- in a compressed layer, its **compressor state row**: the compressor's kv | gate
  projections (a CSA layer's indexer's too), pooled into an entry with the rows of the
  window's other tokens when its last token is computed, so read no further back than
  ``reach`` (HCA: ``rate``; CSA, whose entries also pool the window before: ``2 rate``).
  These rows are the compressors' partial state; a sliding-window group per compressed kind
  (their widths differ) holds them, freed behind the reach.
- its **share of the compressed entries**: an entry (and in a CSA layer the indexer's key)
  of ``rate`` tokens is written in pieces, ``(head_dim + index_head_dim) / rate`` values in
  the slot of each of its tokens. Every compressed layer's pieces sit side by side in one
  row of group 0, which holds exactly the entries' bytes (V4-Flash: 3,292 values a token),
  is hashed, cached, stored, pulled and handed over as any group 0.

An entry's pieces are final only once its window closes: group 0's ``entry_tokens`` is the
longest window (128 tokens in V4-Flash), and the block manager publishes a block, or reuses
one from a prefix hit, only at multiples of it (``BlockManager.granule``).

With ``hybrid_kv_cache: false`` (and in the MTP drafter's engine) one group holds every layer:
a row of the key, the state row and the layer's pieces, as wide as the widest layer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.v4_config import V4Config

STATE_KINDS = ("csa", "hca")


@dataclass(frozen=True)
class LayerCache:
    """One layer's values a token. Key; state row: compressor kv | gate, indexer kv | gate.
    Entry: the pooled entry (``entry``) | the indexer's key (``index_key``), of ``rate``
    tokens, ``piece`` values in each token's slot."""

    key: int
    compressor: int = 0
    indexer: int = 0
    entry: int = 0
    index_key: int = 0
    rate: int = 0
    reach: int = 0
    """The furthest back a step's pooling reads its state rows from its first position."""

    @classmethod
    def of(cls, v4: V4Config, kind: str) -> LayerCache:
        dim, index, rate = v4.head_dim, v4.index_head_dim, v4.rate(kind)
        if kind == "sliding":
            return cls(dim)
        if kind == "hca":
            return cls(dim, 2 * dim, 0, dim, 0, rate, rate)
        return cls(dim, 4 * dim, 4 * index, dim, index, rate, 2 * rate)

    def __post_init__(self) -> None:
        if self.rate and (self.entry + self.index_key) % self.rate:
            raise ValueError("deepseek_v4: an entry must split evenly over its window's tokens")

    @property
    def state_width(self) -> int:
        return self.compressor + self.indexer

    @property
    def piece(self) -> int:
        return (self.entry + self.index_key) // self.rate if self.rate else 0

    def state_part(self, index: int) -> slice:
        """0 compressor rows, 1 indexer rows."""
        return slice(0, self.compressor) if index == 0 else slice(self.compressor, None)


def layer_caches(v4: V4Config) -> list[LayerCache]:
    return [LayerCache.of(v4, kind) for kind in v4.layer_kinds]


def entry_tokens(v4: V4Config) -> int:
    """Tokens whose slots one entry's pieces fill, the longest of the layers'."""
    return math.lcm(1, *(cache.rate for cache in layer_caches(v4) if cache.rate))


def cache_groups(v4: V4Config) -> list[KVCacheGroup]:
    """Group 0: every compressed layer's entry pieces in one row; group 1: every layer's
    key, for the window; then a group of state rows per compressed kind present (CSA, HCA),
    each as far back as its pooling reaches."""
    caches = layer_caches(v4)
    compressed = tuple(i for i, cache in enumerate(caches) if cache.rate)
    if not compressed:
        raise ValueError("deepseek_v4 KV cache groups need a compressed (CSA or HCA) layer")
    width = sum(caches[i].piece for i in compressed)
    everyone = tuple(range(len(caches)))
    groups = [
        KVCacheGroup(KVCacheSpec(1, 1, 1, width, entry_tokens(v4)), compressed),
        KVCacheGroup(KVCacheSpec(1, len(caches), 1, v4.head_dim), everyone, v4.window),
    ]
    for kind in STATE_KINDS:
        layers = tuple(i for i, k in enumerate(v4.layer_kinds) if k == kind)
        if layers:
            first = caches[layers[0]]
            spec = KVCacheSpec(1, len(layers), 1, first.state_width)
            groups.append(KVCacheGroup(spec, layers, first.reach))
    return groups


def single_spec(v4: V4Config) -> KVCacheSpec:
    """Every layer in one group: key | state row | entry pieces, as wide as the widest
    layer's."""
    caches = layer_caches(v4)
    width = max(cache.key + cache.state_width + cache.piece for cache in caches)
    return KVCacheSpec(1, len(caches), 1, width, entry_tokens(v4))
