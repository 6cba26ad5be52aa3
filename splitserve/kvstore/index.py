"""Prefix index: which holder keeps which KV block, in which tier.

A *holder* is whoever can hand a block back: a worker (its device cache) or a node's block
store (host memory, disk). Workers publish the hashes they store and evict; the router asks,
for a prompt's chained block hashes (kvstore/hashing.py), how many leading blocks each holder
has. Because hashes are chained, block i of a prompt is only useful when blocks 0..i-1 are
there too, so a holder's prefix ends at its first missing block.

Two backends share the interface: ``MemoryPrefixIndex`` (one process, the local default) and
``RedisPrefixIndex`` (kvstore/redis_index.py, shared by every router and worker). Entries expire
``ttl_s`` after their last publish, so a holder that dies without saying so fades out.
"""

from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from urllib.parse import urlparse

TIERS: tuple[str, ...] = ("device", "host", "disk")
"""Tiers from fastest to slowest; a holder's prefix is reported at its slowest block's tier."""
TIER_RANK: dict[str, int] = {tier: rank for rank, tier in enumerate(TIERS)}
DEFAULT_TTL_S = 7 * 24 * 3600.0

Prefixes = dict[str, tuple[int, str]]
"""holder -> (leading blocks cached there, tier bounding the load of that prefix)."""


def check_tier(tier: str) -> None:
    if tier not in TIER_RANK:
        raise ValueError(f"unknown tier {tier!r}; expected one of {', '.join(TIERS)}")


class PrefixIndex(ABC):
    """Where cached KV blocks live, by holder and tier.

    Lookups may be stale by at most the writers' publish interval (see PublishBuffer): a hit
    is a hint, and a holder that no longer has a block treats it as a miss and recomputes.
    """

    @abstractmethod
    def publish(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int]
    ) -> None:
        """Record that ``holder`` now has ``stored`` and no longer has ``evicted`` in ``tier``.

        Evictions apply after stores, so a hash in both lists ends up absent.
        """

    @abstractmethod
    def longest_prefixes(self, block_hashes: Sequence[int]) -> Prefixes:
        """For each holder with at least the first block: its cached prefix length and tier.

        A block counts for a holder when any of its tiers has it; the reported tier is the
        slowest among the fastest copies of the prefix's blocks. Holders without block 0 are
        absent. An unreachable backend answers {} (nothing cached) rather than raising.
        """

    @abstractmethod
    def rebuild(self, holder: str, tier: str, block_hashes: Iterable[int]) -> None:
        """Replace everything ``holder`` has in ``tier`` with exactly ``block_hashes``."""

    @abstractmethod
    def drop_holder(self, holder: str) -> None:
        """Forget every block of ``holder`` in every tier (it died or restarted empty)."""

    @abstractmethod
    def healthy(self) -> bool:
        """False while the backend is unreachable; lookups then answer {}."""

    @property
    @abstractmethod
    def epoch(self) -> int:
        """Changes whenever the index may have lost entries; writers then rebuild."""

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections."""


class PrefixScan:
    """Walks a prompt's blocks in order, tracking which holders still have every block."""

    def __init__(self) -> None:
        self.result: Prefixes = {}
        self._alive: dict[str, int] | None = None
        self._index = 0

    def add_block(self, tiers_by_holder: dict[str, int]) -> bool:
        """Feed one block's holders (holder -> fastest tier rank); False once no holder is left."""
        self._index += 1
        if self._alive is None:
            alive = tiers_by_holder
        else:
            alive = {
                holder: max(rank, tiers_by_holder[holder])
                for holder, rank in self._alive.items()
                if holder in tiers_by_holder
            }
        self._alive = alive
        for holder, rank in alive.items():
            self.result[holder] = (self._index, TIERS[rank])
        return bool(alive)


class MemoryPrefixIndex(PrefixIndex):
    """The index in this process's memory; expiry follows the injected monotonic clock."""

    def __init__(self, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = math.inf if ttl_s is None else ttl_s
        self._clock = clock
        self._blocks: dict[int, dict[tuple[str, str], float]] = {}
        self._by_holder: dict[tuple[str, str], set[int]] = {}

    def publish(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int]
    ) -> None:
        check_tier(tier)
        field = (holder, tier)
        owned = self._by_holder.setdefault(field, set())
        expiry = self._clock() + self._ttl_s
        for block_hash in stored:
            self._blocks.setdefault(block_hash, {})[field] = expiry
            owned.add(block_hash)
        for block_hash in evicted:
            self._remove(block_hash, field)
            owned.discard(block_hash)

    def longest_prefixes(self, block_hashes: Sequence[int]) -> Prefixes:
        now = self._clock()
        scan = PrefixScan()
        for block_hash in block_hashes:
            fields = self._blocks.get(block_hash)
            if not fields:
                break
            best: dict[str, int] = {}
            for (holder, tier), expiry in fields.items():
                if expiry > now:
                    rank = TIER_RANK[tier]
                    best[holder] = min(rank, best.get(holder, rank))
            if not scan.add_block(best):
                break
        return scan.result

    def rebuild(self, holder: str, tier: str, block_hashes: Iterable[int]) -> None:
        check_tier(tier)
        self._drop_field((holder, tier))
        self.publish(holder, tier, list(block_hashes), ())

    def drop_holder(self, holder: str) -> None:
        for tier in TIERS:
            self._drop_field((holder, tier))

    def healthy(self) -> bool:
        return True

    @property
    def epoch(self) -> int:
        return 0

    def __len__(self) -> int:
        """Number of distinct block hashes with at least one holder (expired ones included)."""
        return len(self._blocks)

    def _drop_field(self, field: tuple[str, str]) -> None:
        for block_hash in self._by_holder.pop(field, set()):
            self._remove(block_hash, field)

    def _remove(self, block_hash: int, field: tuple[str, str]) -> None:
        fields = self._blocks.get(block_hash)
        if fields is not None:
            fields.pop(field, None)
            if not fields:
                del self._blocks[block_hash]


def make_index(url: str, ttl_s: float = DEFAULT_TTL_S) -> PrefixIndex:
    """Build the index named by ``prefix_index.url``.

    ``memory://`` is this process's index. ``redis://[:password@]host:port/db`` and
    ``rediss://`` (TLS; certificates through redis-py's URL query parameters) reach Redis.
    """
    scheme = urlparse(url).scheme
    if scheme == "memory":
        return MemoryPrefixIndex(ttl_s)
    if scheme in ("redis", "rediss", "unix"):
        from splitserve.kvstore.redis_index import RedisPrefixIndex

        return RedisPrefixIndex(url, ttl_s)
    raise ValueError(f"prefix_index.url {url!r}: expected memory://, redis:// or rediss://")
