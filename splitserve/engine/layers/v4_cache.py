"""What DeepSeek-V4 keeps in its KV cache, per layer and token, and how that splits into KV
cache groups (``kv_cache_spec.KVCacheGroup``).

Each layer keeps two things a token:

- its **window row**: the token's key, and in a compressed layer its compressor's kv | gate
  projections (a CSA layer also its indexer's). A query reads the keys of its last ``window``
  positions; a window of ``rate`` tokens (CSA: two windows) is pooled into an entry from the
  rows of its tokens when its last token is computed. So no position further back than
  ``reach`` is ever read: the rows live in sliding-window groups (one per layer kind, as the
  rows' widths differ), whose blocks go back to the pool behind the reach.
- its **share of the compressed entries**: an entry (and in a CSA layer the indexer's key)
  of ``rate`` tokens is written in pieces, ``(head_dim + index_head_dim) / rate`` values in
  the slot of each of its tokens. Every compressed layer's pieces sit side by side in one
  row of group 0, which holds exactly the entries' bytes (V4-Flash: 3,292 values a token),
  is hashed, cached, stored, pulled and handed over as any group 0.

An entry's pieces are final only once its window closes: group 0's ``entry_tokens`` is the
longest window (128 tokens in V4-Flash), and the block manager publishes a block, or reuses
one from a prefix hit, only at multiples of it (``BlockManager.granule``).

With ``hybrid_kv_cache: false`` (and in the MTP drafter's engine) one group holds every layer:
a row of the window row then the layer's pieces, as wide as the widest layer's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.v4_config import V4Config

KIND_ORDER = ("sliding", "csa", "hca")


@dataclass(frozen=True)
class LayerCache:
    """One layer's values a token. Window row: key | compressor kv | gate | indexer kv | gate.
    Entry: the pooled entry (``entry``) | the indexer's key (``index_key``), of ``rate``
    tokens, ``piece`` values in each token's slot."""

    key: int
    compressor: int = 0
    indexer: int = 0
    entry: int = 0
    index_key: int = 0
    rate: int = 0
    reach: int = 0
    """The furthest a step reads back from its first position: the window, or the tokens a
    window closing at that position pools (CSA: the earlier window's too)."""

    @classmethod
    def of(cls, v4: V4Config, kind: str) -> LayerCache:
        dim, index, rate = v4.head_dim, v4.index_head_dim, v4.rate(kind)
        if kind == "sliding":
            return cls(dim, reach=v4.window)
        if kind == "hca":
            return cls(dim, 2 * dim, 0, dim, 0, rate, max(v4.window, rate))
        return cls(dim, 4 * dim, 4 * index, dim, index, rate, max(v4.window, 2 * rate))

    def __post_init__(self) -> None:
        if self.rate and (self.entry + self.index_key) % self.rate:
            raise ValueError("deepseek_v4: an entry must split evenly over its window's tokens")

    @property
    def window_width(self) -> int:
        return self.key + self.compressor + self.indexer

    @property
    def piece(self) -> int:
        return (self.entry + self.index_key) // self.rate if self.rate else 0

    def window_part(self, index: int) -> slice:
        """0 key, 1 compressor rows, 2 indexer rows."""
        sizes = (self.key, self.compressor, self.indexer)
        start = sum(sizes[:index])
        return slice(start, start + sizes[index])


def layer_caches(v4: V4Config) -> list[LayerCache]:
    return [LayerCache.of(v4, kind) for kind in v4.layer_kinds]


def entry_tokens(v4: V4Config) -> int:
    """Tokens whose slots one entry's pieces fill, the longest of the layers'."""
    return math.lcm(1, *(cache.rate for cache in layer_caches(v4) if cache.rate))


def cache_groups(v4: V4Config) -> list[KVCacheGroup]:
    """Group 0: every compressed layer's entry pieces in one row; then a window group per
    layer kind present (sliding, CSA, HCA), each as far back as its layers reach."""
    caches = layer_caches(v4)
    compressed = tuple(i for i, cache in enumerate(caches) if cache.rate)
    if not compressed:
        raise ValueError("deepseek_v4 KV cache groups need a compressed (CSA or HCA) layer")
    width = sum(caches[i].piece for i in compressed)
    groups = [KVCacheGroup(KVCacheSpec(1, 1, 1, width, entry_tokens(v4)), compressed)]
    for kind in KIND_ORDER:
        layers = tuple(i for i, k in enumerate(v4.layer_kinds) if k == kind)
        if layers:
            first = caches[layers[0]]
            spec = KVCacheSpec(1, len(layers), 1, first.window_width)
            groups.append(KVCacheGroup(spec, layers, first.reach))
    return groups


def single_spec(v4: V4Config) -> KVCacheSpec:
    """Every layer in one group: window row | entry pieces, as wide as the widest layer's."""
    caches = layer_caches(v4)
    width = max(cache.window_width + cache.piece for cache in caches)
    return KVCacheSpec(1, len(caches), 1, width, entry_tokens(v4))
