"""The device prefix cache's link to a slower block store and to whoever tracks its contents.

The engine stays free of Redis, sockets and files: a worker hands it a ``BlockCache`` (the
node's ``kvstore.store.BlockStore``) and a ``CacheEvents`` sink (a ``kvstore.publish``
``PublishBuffer``). Then:

- every block that gets a hash is copied into the store after the step that computed it
  (write-through, with its request's traffic class), so a block later evicted from the device
  cache is already in the host tier. On CUDA the copy to the host runs on a stream of its own
  and a thread puts the blocks into the store once it has landed (engine/store_writer.py):
  the loop never waits for it (a synchronous copy per block took a quarter of a served H200
  loop at 8 req/s). A block still on its way is on the device too. Only as many of a flush's
  blocks are copied as the store can keep (``max_blocks``: the host tier's room when no disk
  tier is below it), the newest, which is what an LRU of that size keeps of the burst. On CUDA
  the copies land in staging slabs allocated once (``SLAB_BYTES`` each, so with a disk tier a
  flush also copies at most a slab's worth, the newest); a flush that finds every slab still
  being written out copies nothing (``skipped_blocks``): the loop never waits for the store;
- every device store and eviction is reported as a ``device`` tier event;
- a waiting request whose device-cached prefix ends early continues it with blocks the store
  has: each is loaded into a free device block and registered under its hash. A store miss
  (absent, expired, corrupt) ends the prefix there; the rest is computed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from splitserve.engine.block_cache import BlockCache, CacheEvents
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request
from splitserve.engine.store_writer import SLAB_BYTES, SLABS, PinnedSlabs, StoreWriter


class PrefixCache:
    def __init__(
        self,
        block_manager: BlockManager,
        runner: ModelRunner,
        store: BlockCache | None,
        events: CacheEvents | None,
    ) -> None:
        self.block_manager = block_manager
        self.runner = runner
        self.store = store
        self.events = events
        self._pending: dict[int, tuple[int, str | None]] = {}
        """Committed since the last flush: block hash -> (block id, traffic class), oldest
        first; an evicted block leaves it at once."""
        self._block_bytes = runner.kv_bytes_per_block()
        self._writer: StoreWriter | None = None
        """Puts CUDA copies into the store off the loop thread (started by the first)."""
        self.slabs: PinnedSlabs | None = None
        """Where CUDA copies land (None on a CPU, whose copies are synchronous)."""
        self.skipped_blocks = 0
        """Blocks not written through because every staging slab was still in use."""
        if store is not None and runner.device.type == "cuda":
            limit = store.max_blocks(self._block_bytes)
            per_slab = min(
                block_manager.num_blocks,
                max(1, SLAB_BYTES // self._block_bytes),
                limit if limit is not None else block_manager.num_blocks,
            )
            if per_slab:
                self.slabs = PinnedSlabs(SLABS, runner.kv_block_shape(per_slab), runner.kv_dtype)
        block_manager.on_commit = self._committed
        block_manager.on_evict = self._evicted
        if store is not None:
            block_manager.loader = self._load

    def flush(self, wait: bool = False) -> None:
        """Copy the blocks committed since the last flush to the store (after a step): at once
        on CPU; on CUDA the copy runs on its own stream and the StoreWriter thread puts it
        into the store once it has landed. wait: return once every copy is in the store."""
        pending, self._pending = self._pending, {}  # filled only when there is a store
        if pending and self.store is not None:
            self._copy_out(self.store, [(h, b, c) for h, (b, c) in pending.items()])
        if wait and self._writer is not None:
            self._writer.drain()

    def _copy_out(self, store: BlockCache, pending: list[tuple[int, int, str | None]]) -> None:
        """The newest of ``pending`` that the store keeps, copied out and put into it."""
        limit = store.max_blocks(self._block_bytes)
        if limit is not None:
            pending = pending[-limit:] if limit else []
        if not pending:
            return
        slab = None
        if self.slabs is not None:
            slab = self.slabs.acquire()
            if slab is None:  # the writer is behind: this burst stays on the device only
                self.skipped_blocks += len(pending)
                return
            pending = pending[-len(slab) :]
        copy = self.runner.blocks_to_host([block_id for _, block_id, _ in pending], slab)
        if slab is not None and self.slabs is not None:  # (the second: for mypy)
            copy.release = self.slabs.releaser(slab)
        blocks = [(block_hash, traffic_class) for block_hash, _, traffic_class in pending]
        if copy.done is None:
            for i, (block_hash, traffic_class) in enumerate(blocks):
                store.put(block_hash, copy.tensor[i], traffic_class)
            if copy.release is not None:
                copy.release()
            return
        if self._writer is None:
            self._writer = StoreWriter(store)
        self._writer.submit(blocks, copy)

    def _committed(self, block_hash: int, block_id: int, req: Request) -> None:
        if self.store is not None:
            self._pending[block_hash] = (block_id, req.traffic_class)
        if self.events is not None:
            self.events.stored("device", [block_hash])

    def _evicted(self, block_hash: int) -> None:
        self._pending.pop(block_hash, None)
        if self.events is not None:
            self.events.evicted("device", [block_hash])

    def _load(self, block_hashes: Sequence[int]) -> list[tuple[int, str]]:
        assert self.store is not None
        limit = min(len(block_hashes), self.block_manager.num_free_blocks)
        found = self.store.load_prefix(block_hashes[:limit]) if limit else []
        claimed: list[tuple[int, str]] = []
        for _, tier in found:
            block_id = self.block_manager.claim_free()
            assert block_id is not None
            claimed.append((block_id, tier))
        if not claimed:
            return []
        kv = torch.stack([tensor for tensor, _ in found], dim=2)
        self.runner.scatter_blocks([block_id for block_id, _ in claimed], kv)
        for block_hash, (block_id, _) in zip(block_hashes, claimed):
            self.block_manager.register(block_id, block_hash)
        if self.events is not None:
            self.events.stored("device", list(block_hashes[: len(claimed)]))
        return claimed
