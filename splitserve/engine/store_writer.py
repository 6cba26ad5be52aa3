"""The thread that moves device blocks copied to the host into the block store.

On CUDA the prefix cache's write-through copies land in pinned memory asynchronously
(``ModelRunner.blocks_to_host``); putting them into the store (a host copy per block, and with
a disk tier the file writes of what the host tier pushes out) is work of the size of the
blocks, which on the loop thread took a fifth of a saturated served step on an H200. This
thread does it instead; the store is thread-safe (its own lock), and torch's copies release
the GIL.

The copies land in a few pinned staging slabs allocated once (``PinnedSlabs``): pinning
memory per flush (cudaHostAlloc of up to the host tier's size) cost tens of milliseconds of
a saturated loop's step, and a writer that falls behind must not make the loop allocate
more. A flush that finds no free slab writes nothing through; its blocks stay on the device.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from splitserve.engine.block_cache import BlockCache

if TYPE_CHECKING:
    from splitserve.engine.model_runner import HostBlocks

SLABS = 2
SLAB_BYTES = 256 << 20
"""Staging for one flush: 256 MiB holds 128 blocks of 16 tokens of a Llama-3-8B."""

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
                if copy.release is not None:
                    copy.release()
                self._queue.task_done()


class PinnedSlabs:
    """``count`` pinned host buffers of ``shape``, handed out without waiting (pin=False:
    plain host memory, for a machine without CUDA)."""

    def __init__(
        self, count: int, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = True
    ) -> None:
        self._lock = threading.Lock()
        self._free = [torch.empty(shape, dtype=dtype, pin_memory=pin) for _ in range(count)]

    def acquire(self) -> torch.Tensor | None:
        """A free slab, or None when every one is still being written out."""
        with self._lock:
            return self._free.pop() if self._free else None

    def releaser(self, slab: torch.Tensor) -> Callable[[], None]:
        def release() -> None:
            with self._lock:
                self._free.append(slab)

        return release
