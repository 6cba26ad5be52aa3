"""The tiered KV block store of one node: host memory first, then disk.

Data enters through ``put`` (a block evicted from a worker's device cache, or one a prefill
worker computed) into the host tier; when the host tier needs room its least recently used
blocks move to disk, and the disk tier's own least recently used blocks are deleted. A block
also leaves when its retention ends: the request's traffic class picks the TTL. ``get`` and
``load_prefix`` read blocks back; a disk hit is copied up to the host tier. Every change is
reported to a ``StoreListener`` (a PublishBuffer) so the prefix index can follow.

A missing, expired, corrupt or truncated block is a miss, never a wrong block: the caller
recomputes it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitserve.kvstore.disk_tier import DiskTier
from splitserve.kvstore.host_tier import HostEntry, HostTier

DAY_S = 24 * 3600.0


def _default_ttls() -> dict[str, float]:
    return {"agent": 3 * DAY_S, "chat": 7 * DAY_S}


@dataclass(frozen=True)
class RetentionPolicy:
    """How long a block is kept, by the traffic class of the request that stored it."""

    ttl_s: Mapping[str, float] = field(default_factory=_default_ttls)
    default_class: str = "chat"

    def __post_init__(self) -> None:
        if self.default_class not in self.ttl_s:
            raise ValueError(f"retention: default class {self.default_class!r} has no TTL")
        if any(ttl <= 0 for ttl in self.ttl_s.values()):
            raise ValueError("retention: TTLs must be positive")

    def ttl(self, traffic_class: str | None) -> float:
        """TTL of ``traffic_class`` (None: the default class); unknown classes are an error."""
        name = self.default_class if traffic_class is None else traffic_class
        if name not in self.ttl_s:
            raise ValueError(f"unknown traffic class {name!r}; known: {sorted(self.ttl_s)}")
        return self.ttl_s[name]


@dataclass(frozen=True)
class BlockStoreConfig:
    host_bytes: int
    disk_path: str | None = None
    disk_bytes: int = 0
    retention: RetentionPolicy = field(default_factory=RetentionPolicy)
    fsync: bool = False


class StoreListener(Protocol):
    """Told about every block that enters or leaves a tier (PublishBuffer fits)."""

    def stored(self, tier: str, block_hashes: Sequence[int]) -> None: ...

    def evicted(self, tier: str, block_hashes: Sequence[int]) -> None: ...


class BlockStore:
    """Per-node KV blocks by block hash, each ``[parts, layers, block_size, heads, dim]``
    (K and V, or one latent: engine/kv_cache_spec.py)."""

    def __init__(
        self,
        config: BlockStoreConfig,
        listener: StoreListener | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.host = HostTier(config.host_bytes)
        self.disk = (
            DiskTier(config.disk_path, config.disk_bytes, config.fsync)
            if config.disk_path
            else None
        )
        self._listener = listener
        self._clock = clock
        self._lock = threading.Lock()

    def put(self, block_hash: int, kv: torch.Tensor, traffic_class: str | None = None) -> None:
        """Keep a copy of ``kv``; a block already held keeps the later of the two expiries."""
        expiry = self._clock() + self.config.retention.ttl(traffic_class)
        with self._lock:
            if self._extend(block_hash, expiry):
                return
        # The copy outside the lock: the loop thread's lookups must not wait for it.
        tensor = kv.detach().to("cpu", copy=True).contiguous()
        with self._lock:
            if not self._extend(block_hash, expiry):  # or another thread put it meanwhile
                self._insert_host(block_hash, HostEntry(tensor, expiry))

    def _extend(self, block_hash: int, expiry: float) -> bool:
        """A block the host tier holds keeps the later of its two expiries; False if absent."""
        old = self.host.get(block_hash)
        if old is not None:
            old.expiry = max(old.expiry, expiry)
        return old is not None

    def max_blocks(self, block_bytes: int) -> int | None:
        """How many of a burst of new blocks of ``block_bytes`` can stay: the host tier's
        capacity with no disk tier below it, else None (its victims go down to disk)."""
        return None if self.disk is not None else self.config.host_bytes // block_bytes

    def get(
        self, block_hash: int, traffic_class: str | None = None
    ) -> tuple[torch.Tensor, str] | None:
        """The block and the tier it came from, or None; with a class, its TTL is extended."""
        expiry = (
            None
            if traffic_class is None
            else self._clock() + self.config.retention.ttl(traffic_class)
        )
        with self._lock:
            return self._get(block_hash, expiry)

    def load_prefix(self, block_hashes: Sequence[int]) -> list[tuple[torch.Tensor, str]]:
        """The leading blocks of a prompt that the store has, stopping at the first miss."""
        found: list[tuple[torch.Tensor, str]] = []
        with self._lock:
            for block_hash in block_hashes:
                hit = self._get(block_hash, None)
                if hit is None:
                    break
                found.append(hit)
        return found

    def expire(self) -> int:
        """Delete every block whose retention has ended; returns how many went."""
        now = self._clock()
        with self._lock:
            host = self.host.expired(now)
            for block_hash in host:
                self.host.pop(block_hash)
            disk = self.disk.expired(now) if self.disk is not None else []
            for block_hash in disk:
                self._drop_disk(block_hash)
        self._notify("evicted", "host", host)
        self._notify("evicted", "disk", disk)
        return len(host) + len(disk)

    def snapshot(self) -> dict[str, list[int]]:
        """Every tier -> the hashes it holds (the PublishBuffer's rebuild source)."""
        with self._lock:
            state = {"host": self.host.keys()}
            if self.disk is not None:
                state["disk"] = self.disk.keys()
            return state

    def _get(self, block_hash: int, expiry: float | None) -> tuple[torch.Tensor, str] | None:
        now = self._clock()
        entry = self.host.get(block_hash)
        if entry is not None:
            if entry.expiry > now:
                entry.expiry = max(entry.expiry, expiry or 0.0)
                return entry.tensor, "host"
            self.host.pop(block_hash)
            self._notify("evicted", "host", [block_hash])
        return self._get_disk(block_hash, now, expiry)

    def _get_disk(
        self, block_hash: int, now: float, expiry: float | None
    ) -> tuple[torch.Tensor, str] | None:
        if self.disk is None or not self.disk.adopt(block_hash):
            return None
        disk_expiry = self.disk.expiry(block_hash) or 0.0
        tensor = self.disk.get(block_hash) if disk_expiry > now else None
        if tensor is None:
            self._drop_disk(block_hash)
            self._notify("evicted", "disk", [block_hash])
            return None
        disk_expiry = max(disk_expiry, expiry or 0.0)
        self.disk.set_expiry(block_hash, disk_expiry)
        self._insert_host(block_hash, HostEntry(tensor, disk_expiry))
        return tensor, "disk"

    def _insert_host(self, block_hash: int, entry: HostEntry) -> None:
        """Put into the host tier and move what it pushes out down to disk."""
        victims = self.host.put(block_hash, entry)
        if block_hash in self.host:
            self._notify("stored", "host", [block_hash])
        demoted = [(h, e) for h, e in victims if h != block_hash]
        self._notify("evicted", "host", [h for h, _ in demoted])
        for victim_hash, victim in victims:
            self._demote(victim_hash, victim)

    def _demote(self, block_hash: int, entry: HostEntry) -> None:
        if self.disk is None or entry.expiry <= self._clock():
            return
        if block_hash in self.disk:
            old = self.disk.expiry(block_hash) or 0.0
            self.disk.set_expiry(block_hash, max(old, entry.expiry))
            return
        removed = self.disk.put(block_hash, entry.tensor, entry.expiry)
        self._notify("evicted", "disk", removed)
        if block_hash in self.disk:
            self._notify("stored", "disk", [block_hash])

    def _drop_disk(self, block_hash: int) -> None:
        if self.disk is not None:
            self.disk.pop(block_hash)

    def _notify(self, event: str, tier: str, block_hashes: Sequence[int]) -> None:
        if self._listener is not None and block_hashes:
            getattr(self._listener, event)(tier, block_hashes)
