"""Paged KV blocks: allocation, ref counts, prefix reuse and LRU eviction.

A block whose ref count drops to zero keeps its contents and its hash: it sits in the free
queue (least recently freed first) and can be claimed again by a request with the same prefix
until a new allocation evicts it.

Hooks (set by engine/prefix_cache.py when a block store is attached): ``on_commit`` sees each
block that got a hash, ``on_evict`` each hashed block about to be reused, and ``loader`` may
extend a request's device-cached prefix with blocks it fills from elsewhere.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Sequence

from splitserve.engine.request import Request
from splitserve.kvstore.hashing import hash_block, image_extra

PrefixLoader = Callable[[Sequence[int]], list[tuple[int, str]]]
"""Block hashes (a prompt's next uncached ones) -> (filled block id, tier it came from) for
the leading ones it could load; each block is claimed (ref count 1) and registered."""


class Block:
    __slots__ = ("block_hash", "block_id", "ref_count")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.block_hash: int | None = None


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root: int,
        entry_tokens: int = 1,
    ) -> None:
        """root: the hash chain's start (kvstore/hashing.py: hash_root). entry_tokens: group
        0's (``KVCacheSpec.entry_tokens``): blocks are published and reused in runs of
        ``granule`` blocks, whose contents are final together."""
        self.block_size = block_size
        self.granule = math.lcm(block_size, entry_tokens) // block_size
        self.root = root
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[int, int] = {}
        self._hashes: dict[str, list[int]] = {}
        self.on_commit: Callable[[int, int, Request], None] | None = None
        self.on_evict: Callable[[int], None] | None = None
        self.loader: PrefixLoader | None = None
        self.last_hit_tokens: dict[str, int] = {}
        """Tier -> tokens of the prefix that the last ``allocate_prefix`` claimed."""

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_prefix(self, req: Request) -> int:
        """Claim the cached blocks of req's longest known prefix; returns its token count.

        At least one token is always left to compute, so the last position's logits exist.
        """
        self.last_hit_tokens = {}
        if not self.enable_prefix_caching:
            return 0
        hashes = self._block_hashes(req)
        usable = (req.num_tokens - 1) // self.block_size
        for block_hash in hashes[:usable]:
            block_id = self.cached.get(block_hash)
            if block_id is None:
                break
            self._take(block_id)
            req.block_table.append(block_id)
        if req.block_table:
            self.last_hit_tokens["device"] = len(req.block_table) * self.block_size
        if self.loader is not None and len(req.block_table) < usable:
            for block_id, tier in self.loader(hashes[len(req.block_table) : usable]):
                req.block_table.append(block_id)
                hits = self.last_hit_tokens.get(tier, 0)
                self.last_hit_tokens[tier] = hits + self.block_size
        whole = len(req.block_table) // self.granule * self.granule
        if whole < len(req.block_table):  # a run cut short: its last entries are not final
            self.trim(req, whole * self.block_size)
            self.last_hit_tokens = first_tokens(self.last_hit_tokens, whole * self.block_size)
        return len(req.block_table) * self.block_size

    def cached_prefix_tokens(self, req: Request) -> int:
        """Tokens of req's prompt that allocate_prefix would find in this device cache now
        (a look, nothing claimed)."""
        if not self.enable_prefix_caching:
            return 0
        usable = (req.num_tokens - 1) // self.block_size
        found = 0
        for block_hash in self._block_hashes(req)[:usable]:
            if block_hash not in self.cached:
                break
            found += 1
        return found // self.granule * self.granule * self.block_size

    def claim_free(self) -> int | None:
        """Take the least recently freed block for new contents (ref count 1), or None."""
        if not self.free_queue:
            return None
        block_id, _ = self.free_queue.popitem(last=False)
        self._evict(block_id)
        self.blocks[block_id].ref_count = 1
        return block_id

    def register(self, block_id: int, block_hash: int) -> None:
        """Publish a block whose contents were loaded from elsewhere under its hash."""
        if block_hash not in self.cached:
            self.blocks[block_id].block_hash = block_hash
            self.cached[block_hash] = block_id

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        """Make req's block table cover its computed tokens plus num_new_tokens."""
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        missing = needed - len(req.block_table)
        if missing > len(self.free_queue):
            return False
        for _ in range(missing):
            block_id = self.claim_free()
            assert block_id is not None
            req.block_table.append(block_id)
        return True

    def commit(self, req: Request) -> None:
        """Publish the hashes of blocks whose tokens all have KV now."""
        if not self.enable_prefix_caching:
            return
        full = req.num_computed_tokens // self.block_size // self.granule * self.granule
        if full <= req.num_committed_blocks:
            return
        hashes = self._block_hashes(req)
        # With overlapped steps a computed position's token may still be on the device.
        full = min(full, len(hashes) // self.granule * self.granule)
        for index in range(req.num_committed_blocks, full):
            block = self.blocks[req.block_table[index]]
            if block.block_hash is None and hashes[index] not in self.cached:
                block.block_hash = hashes[index]
                self.cached[hashes[index]] = block.block_id
                if self.on_commit is not None:
                    self.on_commit(hashes[index], block.block_id, req)
        req.num_committed_blocks = full

    def free(self, req: Request) -> None:
        """Release req's blocks, tail first, so that prefixes outlive their suffixes."""
        self._release(req.block_table)
        req.block_table = []
        req.num_committed_blocks = 0

    def trim(self, req: Request, num_tokens: int) -> None:
        """Release req's tail blocks past those its first num_tokens tokens use: the slots of
        rejected draft tokens (engine/spec/). Those blocks were never committed."""
        keep = self.blocks_needed(num_tokens)
        self._release(req.block_table[keep:])
        del req.block_table[keep:]

    def _release(self, block_ids: list[int]) -> None:
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue[block_id] = None

    def window_blocks_in_use(self) -> list[int]:
        """Each sliding-window group's blocks held by requests (engine/hybrid_blocks.py)."""
        return []

    def window_pool_blocks(self) -> list[int]:
        """Each sliding-window group's pool size."""
        return []

    def forget(self, request_id: str) -> None:
        self._hashes.pop(request_id, None)

    def _block_hashes(self, req: Request) -> list[int]:
        hashes = self._hashes.setdefault(req.request_id, [])
        tokens = req.all_token_ids
        spans = [image.span for image in req.images]
        parent = hashes[-1] if hashes else self.root
        for start in range(
            len(hashes) * self.block_size, len(tokens) - self.block_size + 1, self.block_size
        ):
            end = start + self.block_size
            parent = hash_block(parent, tokens[start:end], image_extra(spans, start, end))
            hashes.append(parent)
        return hashes

    def _take(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free_queue[block_id]
        block.ref_count += 1

    def _evict(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash)
            block.block_hash = None


def first_tokens(hits: dict[str, int], tokens: int) -> dict[str, int]:
    """Tier -> tokens (in prefix order) cut to the first ``tokens``: the counts of a hit
    that keeps only its first ``tokens``."""
    kept = {}
    for tier, count in hits.items():
        if tokens <= 0:
            break
        kept[tier] = min(count, tokens)
        tokens -= kept[tier]
    return kept
