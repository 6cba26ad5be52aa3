"""The thread that moves device blocks copied to the host into the block store.

On CUDA the prefix cache's write-through copies land in pinned memory asynchronously
(``ModelRunner.blocks_to_host``); putting them into the store (a host copy per block, and with
a disk tier the file writes of what the host tier pushes out) is work of the size of the
blocks, which on the loop thread took a fifth of a saturated served step on an H200. This
thread does it instead; the store is thread-safe (its own lock), and torch's copies release
the GIL.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.engine.model_runner import HostBlocks
    from splitserve.engine.prefix_cache import BlockCache

Batch = tuple[Sequence[tuple[int, str | None]], "HostBlocks"]
"""((block hash, traffic class) of each block, their host copy)."""


class StoreWriter:
    def __init__(self, store: BlockCache) -> None:
        self.store = store
        self._queue: queue.Queue[Batch] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def submit(self, blocks: Sequence[tuple[int, str | None]], copy: HostBlocks) -> None:
        self._queue.put((blocks, copy))

    def drain(self) -> None:
        """Return once every batch submitted so far is in the store."""
        self._queue.join()

    def _run(self) -> None:
        while True:
            blocks, copy = self._queue.get()
            try:
                copy.wait()
                for i, (block_hash, traffic_class) in enumerate(blocks):
                    self.store.put(block_hash, copy.tensor[i], traffic_class)
            finally:
                self._queue.task_done()
