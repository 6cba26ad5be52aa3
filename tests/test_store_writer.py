"""The StoreWriter thread: batches of host copies reach the store in order, and drain waits
for every batch submitted before it."""

from __future__ import annotations

import torch

from splitserve.engine.model_runner import HostBlocks
from splitserve.engine.store_writer import PinnedSlabs, StoreWriter
from splitserve.kvstore.store import BlockStore, BlockStoreConfig


def test_submitted_blocks_are_in_the_store_after_drain_newest_last() -> None:
    block = (2, 3, 4, 5)
    store = BlockStore(BlockStoreConfig(host_bytes=1 << 20))
    writer = StoreWriter(store)
    first = torch.arange(2 * 120, dtype=torch.float32).reshape(2, *block)
    second = -torch.arange(120, dtype=torch.float32).reshape(1, *block)
    writer.submit([(11, None), (12, "agent")], HostBlocks(first, None))
    writer.submit([(13, None)], HostBlocks(second, None))
    writer.drain()
    assert store.host.keys() == [11, 12, 13]
    for block_hash, expected in ((11, first[0]), (12, first[1]), (13, second[0])):
        hit = store.get(block_hash)
        assert hit is not None and hit[1] == "host"
        assert torch.equal(hit[0], expected)
    first.zero_()  # the store holds copies, not views of the batch
    hit = store.get(11)
    assert hit is not None and float(hit[0].abs().sum()) > 0


def test_a_staging_slab_is_handed_back_once_its_blocks_are_in_the_store() -> None:
    block = (2, 3, 4, 5)
    store = BlockStore(BlockStoreConfig(host_bytes=1 << 20))
    writer = StoreWriter(store)
    slabs = PinnedSlabs(1, (2, *block), torch.float32, pin=False)
    slab = slabs.acquire()
    assert slab is not None and slabs.acquire() is None
    slab.copy_(torch.arange(2 * 120, dtype=torch.float32).reshape(2, *block))
    writer.submit([(21, None), (22, None)], HostBlocks(slab, None, slabs.releaser(slab)))
    writer.drain()
    again = slabs.acquire()
    assert again is slab
    again.zero_()  # reused for the next copy: the store keeps its own
    hit = store.get(22)
    assert hit is not None and float(hit[0].sum()) == sum(range(120, 240))
