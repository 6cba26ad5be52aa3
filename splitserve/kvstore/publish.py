"""Batching a holder's store/evict events into the prefix index.

Staleness bound: with ``start()`` (or ``maybe_flush()`` called at least every ``interval_s``),
an event reaches the index at most ``interval_s`` plus one publish round trip after it was
recorded, so the index never points at a block evicted longer ago than that. While the index is
unreachable nothing stale is served (its lookups answer {}); once it is back and its ``epoch``
has moved, the next flush replaces this holder's entries with ``snapshot()``, the holder's
actual contents, which also restores what a restarted Redis lost.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence

from splitserve.kvstore.index import PrefixIndex, check_tier

Snapshot = Callable[[], Mapping[str, Iterable[int]]]
"""Every tier the holder uses -> every block hash it has there right now (maybe none)."""


class PublishBuffer:
    """Collects one holder's events; the latest event per (tier, block) wins."""

    def __init__(
        self,
        index: PrefixIndex,
        holder: str,
        interval_s: float,
        snapshot: Snapshot,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.holder = holder
        self.interval_s = interval_s
        self._snapshot = snapshot
        self._clock = clock
        self._pending: dict[str, dict[int, bool]] = {}
        self._lock = threading.Lock()
        self._flush_lock = threading.Lock()
        self._epoch = index.epoch
        self._last_flush = clock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def stored(self, tier: str, block_hashes: Sequence[int]) -> None:
        """Record that the holder now has ``block_hashes`` in ``tier``."""
        self._record(tier, block_hashes, True)

    def evicted(self, tier: str, block_hashes: Sequence[int]) -> None:
        """Record that the holder no longer has ``block_hashes`` in ``tier``."""
        self._record(tier, block_hashes, False)

    def maybe_flush(self) -> bool:
        """Flush when ``interval_s`` has passed since the last flush; True if it did."""
        if self._clock() - self._last_flush < self.interval_s:
            return False
        self.flush()
        return True

    def flush(self) -> None:
        """Publish the pending events; rebuild this holder's entries if the index lost some."""
        with self._flush_lock:
            self._last_flush = self._clock()
            with self._lock:
                pending, self._pending = self._pending, {}
            for tier, events in pending.items():
                stored = [h for h, present in events.items() if present]
                evicted = [h for h, present in events.items() if not present]
                self.index.publish(self.holder, tier, stored, evicted)
            if self.index.epoch != self._epoch and self.index.healthy():
                self._rebuild()

    def start(self) -> None:
        """Flush every ``interval_s`` on a daemon thread until ``stop()``."""
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="prefix-publish", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the flushing thread after a last flush."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self.flush()

    def _record(self, tier: str, block_hashes: Sequence[int], present: bool) -> None:
        check_tier(tier)
        with self._lock:
            events = self._pending.setdefault(tier, {})
            for block_hash in block_hashes:
                events.pop(block_hash, None)
                events[block_hash] = present

    def _rebuild(self) -> None:
        epoch = self.index.epoch
        state = self._snapshot()
        for tier, block_hashes in state.items():
            self.index.rebuild(self.holder, tier, block_hashes)
        if self.index.epoch == epoch:
            self._epoch = epoch

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.flush()
