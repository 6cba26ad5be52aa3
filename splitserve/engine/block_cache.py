"""The engine's seams to a slower block store and to an index of cached blocks: Protocols that
the kvstore's classes fit, so that the engine imports neither Redis nor files
(engine/prefix_cache.py uses them, engine/store_writer.py writes into a BlockCache)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch


class BlockCache(Protocol):
    """Blocks ``[2, layers, block_size, kv_heads, head_dim]`` by hash (BlockStore fits)."""

    def put(self, block_hash: int, kv: torch.Tensor, traffic_class: str | None = None) -> None: ...

    def max_blocks(self, block_bytes: int) -> int | None:
        """At most how many blocks of one burst of puts can stay (None: no bound), so that
        the engine copies no block that the next ones of the same burst push out."""
        ...

    def load_prefix(self, block_hashes: Sequence[int]) -> list[tuple[torch.Tensor, str]]: ...


class CacheEvents(Protocol):
    """Told which blocks enter and leave a tier (PublishBuffer fits)."""

    def stored(self, tier: str, block_hashes: Sequence[int]) -> None: ...

    def evicted(self, tier: str, block_hashes: Sequence[int]) -> None: ...
