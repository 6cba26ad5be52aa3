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

    @property
    def malformed_entries(self) -> int:
        """Entries found malformed and skipped by lookups since this index was made (a shared
        backend others can write to); 0 for a backend that cannot hold any."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections."""


class PrefixScan:
    """Walks a prompt's blocks in order, tracking which holders still have every block."""

    def __init__(self) -> None:
        self._done: Prefixes = {}
        self._alive: dict[str, int] | None = None
        self._count = 0

    def add_block(self, best: dict[str, int]) -> bool:
        """Feed one block's holders (holder -> fastest tier rank); False once none is left."""
        if self._alive is None:
            self._alive = dict(best)
        else:
            alive = self._alive
            for holder in list(alive):
                rank = best.get(holder)
                if rank is None:
                    self._done[holder] = (self._count, TIERS[alive.pop(holder)])
                elif rank > alive[holder]:
                    alive[holder] = rank
        if not self._alive:
            return False
        self._count += 1
        return True

    @property
    def result(self) -> Prefixes:
        alive = self._alive or {}
        return self._done | {holder: (self._count, TIERS[r]) for holder, r in alive.items()}


class MemoryPrefixIndex(PrefixIndex):
    """The index in this process's memory; expiry follows the injected monotonic clock."""

    def __init__(self, ttl_s: float | None = None, clock: Callable[[], float] = time.monotonic):
        self._ttl_s = math.inf if ttl_s is None else ttl_s
        self._clock = clock
        self._blocks: dict[int, dict[str, dict[int, float]]] = {}
        """block hash -> holder -> tier rank -> expiry"""
        self._by_holder: dict[tuple[str, int], set[int]] = {}

    def publish(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int]
    ) -> None:
        check_tier(tier)
        rank = TIER_RANK[tier]
        owned = self._by_holder.setdefault((holder, rank), set())
        expiry = self._clock() + self._ttl_s
        for block_hash in stored:
            self._blocks.setdefault(block_hash, {}).setdefault(holder, {})[rank] = expiry
            owned.add(block_hash)
        for block_hash in evicted:
            self._remove(block_hash, holder, rank)
            owned.discard(block_hash)

    def longest_prefixes(self, block_hashes: Sequence[int]) -> Prefixes:
        now = self._clock()
        scan = PrefixScan()
        blocks = self._blocks
        for block_hash in block_hashes:
            holders = blocks.get(block_hash)
            if holders is None or not scan.add_block(_live_ranks(holders, now)):
                break
        return scan.result

    def rebuild(self, holder: str, tier: str, block_hashes: Iterable[int]) -> None:
        check_tier(tier)
        self._drop_field(holder, TIER_RANK[tier])
        self.publish(holder, tier, list(block_hashes), ())

    def drop_holder(self, holder: str) -> None:
        for rank in range(len(TIERS)):
            self._drop_field(holder, rank)

    def healthy(self) -> bool:
        return True

    @property
    def epoch(self) -> int:
        return 0

    def __len__(self) -> int:
        """Number of distinct block hashes with at least one holder (expired ones included)."""
        return len(self._blocks)

    def _drop_field(self, holder: str, rank: int) -> None:
        for block_hash in self._by_holder.pop((holder, rank), set()):
            self._remove(block_hash, holder, rank)

    def _remove(self, block_hash: int, holder: str, rank: int) -> None:
        holders = self._blocks.get(block_hash)
        if holders is None or holder not in holders:
            return
        ranks = holders[holder]
        ranks.pop(rank, None)
        if not ranks:
            del holders[holder]
            if not holders:
                del self._blocks[block_hash]


def _live_ranks(holders: dict[str, dict[int, float]], now: float) -> dict[str, int]:
    """holder -> fastest unexpired tier rank of one block."""
    best: dict[str, int] = {}
    for holder, ranks in holders.items():
        for rank, expiry in ranks.items():
            if expiry > now and rank < best.get(holder, len(TIERS)):
                best[holder] = rank
    return best
