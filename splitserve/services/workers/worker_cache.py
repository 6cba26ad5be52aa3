"""A prefill (or colocated) worker's KV cache system: its block store and its publishers.

Holders: the worker id holds the ``device`` tier (its engine's prefix cache) and the ``host``
tier (its own memory); with ``kv_store.disk_path`` the ``disk`` tier is a directory shared by
the workers of a node, held by ``node:<hostname>:<path>``. Each holder's events go through a
``PublishBuffer``:

- ``redis://``: straight to Redis from a publisher thread, which also probes Redis once a
  second so that a restarted (empty) Redis is rebuilt from ``snapshot`` (the device cache's
  hashes, the host tier's, and the disk directory's listing);
- ``memory://``: the index lives in the API server, so the buffers publish into a
  ``ForwardingIndex`` whose updates the worker's loop sends as ``IndexUpdate`` messages.
"""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from splitserve.config import KVStoreConfig, PrefixIndexConfig
from splitserve.kvstore.index import Prefixes, PrefixIndex
from splitserve.kvstore.index_backends import make_index
from splitserve.kvstore.publish import PublishBuffer
from splitserve.kvstore.store import BlockStore, BlockStoreConfig, RetentionPolicy
from splitserve.services.messages import IndexUpdate
from splitserve.services.workers.peer_blocks import StagedBlocks

EXPIRE_INTERVAL_S = 1.0


class ForwardingIndex(PrefixIndex):
    """A worker's stand-in for the API server's in-memory index: updates become messages."""

    def __init__(self) -> None:
        self.updates: queue.Queue[IndexUpdate] = queue.Queue()

    def publish(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int]
    ) -> None:
        self.updates.put(IndexUpdate(holder, tier, list(stored), list(evicted)))

    def longest_prefixes(self, block_hashes: Sequence[int]) -> Prefixes:
        return {}

    def rebuild(self, holder: str, tier: str, block_hashes: Iterable[int]) -> None:
        self.updates.put(IndexUpdate(holder, tier, list(block_hashes), [], rebuild=True))

    def drop_holder(self, holder: str) -> None:
        for tier in ("device", "host", "disk"):
            self.rebuild(holder, tier, [])

    def healthy(self) -> bool:
        return True

    @property
    def epoch(self) -> int:
        return 0


class TierHolders:
    """Sends each tier's events to the PublishBuffer of the holder that owns that tier."""

    def __init__(self, buffers: Mapping[str, PublishBuffer]) -> None:
        self.buffers = buffers

    def stored(self, tier: str, block_hashes: Sequence[int]) -> None:
        self.buffers[tier].stored(tier, block_hashes)

    def evicted(self, tier: str, block_hashes: Sequence[int]) -> None:
        self.buffers[tier].evicted(tier, block_hashes)


class WorkerCache:
    """Built in the worker's process; ``tick`` runs on the engine loop thread."""

    def __init__(
        self,
        worker_id: str,
        index_config: PrefixIndexConfig,
        store_config: KVStoreConfig,
        device_hashes: Callable[[], list[int]],
    ) -> None:
        remote = not index_config.url.startswith("memory://")
        self.forward = None if remote else ForwardingIndex()
        self.index: PrefixIndex = (
            make_index(index_config.url, index_config.ttl_s) if remote else self.forward  # type: ignore[assignment]
        )
        disk_path = store_config.disk_path
        self.node_id = f"node:{socket.gethostname()}:{disk_path}" if disk_path else ""
        interval = index_config.publish_interval_s
        self.worker_buffer = PublishBuffer(
            self.index,
            worker_id,
            interval,
            lambda: {"device": device_hashes(), "host": self.store.snapshot()["host"]},
        )
        self.buffers = [self.worker_buffer]
        tiers = {"device": self.worker_buffer, "host": self.worker_buffer}
        if disk_path:
            node_buffer = PublishBuffer(
                self.index, self.node_id, interval, lambda: {"disk": disk_listing(disk_path)}
            )
            self.buffers.append(node_buffer)
            tiers["disk"] = node_buffer
        self.events = TierHolders(tiers)
        retention = RetentionPolicy(dict(store_config.retention), store_config.default_class)
        config = BlockStoreConfig(
            store_config.host_bytes, disk_path, store_config.disk_bytes, retention
        )
        self.store = BlockStore(config, self.events)
        self.blocks = StagedBlocks(self.store)
        """What the engine loads prefixes from: the store, then blocks pulled from peers."""
        self._next_expire = time.monotonic() + EXPIRE_INTERVAL_S
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if remote:
            self._thread = threading.Thread(
                target=self._publish_loop, name="kv-publish", daemon=True
            )
            self._thread.start()

    def tick(self) -> list[IndexUpdate]:
        """Expire blocks past their retention; the index updates to send (memory:// only)."""
        now = time.monotonic()
        if now >= self._next_expire:
            self._next_expire = now + EXPIRE_INTERVAL_S
            self.store.expire()
        if self.forward is None:
            return []
        for buffer in self.buffers:
            buffer.maybe_flush()
        updates = []
        while not self.forward.updates.empty():
            updates.append(self.forward.updates.get_nowait())
        return updates

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.index.close()

    def _publish_loop(self) -> None:
        interval = self.worker_buffer.interval_s
        while not self._stop.wait(interval):
            self.index.healthy()  # probes at most once a second; notices a reset Redis
            for buffer in self.buffers:
                buffer.flush()


def disk_listing(path: str) -> list[int]:
    """Every block hash with a file in a (shared) disk tier directory."""
    hashes = []
    for file in Path(path).glob("*/*.kv"):
        try:
            hashes.append(int(file.stem, 16))
        except ValueError:
            continue
    return hashes
