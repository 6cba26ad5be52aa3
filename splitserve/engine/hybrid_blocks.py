"""Block tables for models whose layers attend differently (Gemma 3's 5 local : 1 global).

Group 0 (the layers that see the whole context) is a ``BlockManager``: prefix caching,
hashes, the store and the handoff work on it as for any model. Every sliding-window group
(``KVCacheGroup.window``) has a pool of its own and one table per request
(``Request.window_tables``); a table entry of a block no query can read any more is the
group's null block (the runner's scratch block of that group, masked out by the window), and
the block goes back to the pool while the request runs. A request of n tokens thus holds
``n`` positions in group 0 and at most ``window + step`` in each window group.

Sliding groups are never hashed: on a prefix hit, group 0's blocks come from the cache and
the window layers' KV is rebuilt by replaying the end of the prefix (``allocate_prefix``):
its last ``window + allowance`` tokens (bounded replay), or all of it (``allowance`` None:
exact, the window layers' KV then equals an uncached run's). A replayed position keeps
group 0's cached KV (``Request.cached_until``: the runner writes its group-0 K/V nowhere) and
its window layers attend from ``Request.window_from`` on.

Invariants: a request's window tables cover the same block indices as its block table; every
non-null entry is a block of that group's pool held by that request alone.
"""

from __future__ import annotations

from collections.abc import Sequence

from splitserve.engine.block_manager import BlockManager, first_tokens
from splitserve.engine.request import Request


class WindowBlocks:
    """One sliding-window group's pool: block ids ``0 .. num_blocks - 1``; ``num_blocks`` is
    the null block."""

    def __init__(self, num_blocks: int, block_size: int, window: int) -> None:
        self.block_size = block_size
        self.window = window
        self.null = num_blocks
        self.num_blocks = num_blocks
        self.free_ids = list(range(num_blocks - 1, -1, -1))

    def first_block(self, start: int, window_from: int) -> int:
        """The first block a step whose queries start at ``start`` reads (window_from is
        block-aligned: no position before it is ever read)."""
        return max(window_from, start - self.window + 1, 0) // self.block_size

    def missing(self, table: list[int], first: int, needed: int) -> int:
        """Blocks to claim so that ``table`` holds blocks first .. needed - 1."""
        return sum(1 for i in range(first, needed) if i >= len(table) or table[i] == self.null)

    def cover(self, table: list[int], first: int, needed: int) -> None:
        """Free the blocks before ``first``, claim those in first .. needed - 1 (the caller
        checked ``missing`` against ``len(free_ids)``)."""
        for i in range(min(first, len(table))):
            self.release(table, i)
        table.extend([self.null] * (needed - len(table)))
        for i in range(first, needed):
            if table[i] == self.null:
                table[i] = self.free_ids.pop()

    def release(self, table: list[int], index: int) -> None:
        if table[index] != self.null:
            self.free_ids.append(table[index])
            table[index] = self.null

    def trim(self, table: list[int], keep: int) -> None:
        for i in range(keep, len(table)):
            self.release(table, i)
        del table[keep:]


class HybridBlockManager(BlockManager):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        root: int,
        windows: Sequence[tuple[int, int]],
        allowance: int | None,
        entry_tokens: int = 1,
    ) -> None:
        """windows: (pool blocks, window) of each sliding group, in group order.
        allowance: tokens replayed past the longest window on a prefix hit (None: all)."""
        super().__init__(num_blocks, block_size, enable_prefix_caching, root, entry_tokens)
        self.windows = [WindowBlocks(n, block_size, window) for n, window in windows]
        self.longest = max(group.window for group in self.windows)
        self.allowance = allowance

    def replay_start(self, cached: int) -> int:
        """Where the replay of a cached prefix of ``cached`` tokens starts."""
        if self.allowance is None or not cached:
            return 0
        return self._aligned(cached - self.longest - self.allowance)

    def adopted_window_from(self, num_tokens: int) -> int:
        """The first position of the window groups that a handoff of a prompt of
        ``num_tokens`` tokens carries: what the query after it reads."""
        return self._aligned(num_tokens - self.longest)

    def _aligned(self, position: int) -> int:
        return max(position, 0) // self.block_size * self.block_size

    def allocate_prefix(self, req: Request) -> int:
        cached = super().allocate_prefix(req)
        req.cached_until = cached
        req.window_from = self.replay_start(cached)
        # What the replay left uncomputed: the tiers' counts add up to the cached tokens.
        self.last_hit_tokens = first_tokens(self.last_hit_tokens, req.window_from)
        return req.window_from

    def cached_prefix_tokens(self, req: Request) -> int:
        return self.replay_start(super().cached_prefix_tokens(req))

    def reserve_adopted(self, req: Request) -> bool:
        """Blocks for a prompt whose KV arrives from a prefill worker: the whole prompt in
        group 0, the window before its next position in the others."""
        req.window_from = self.adopted_window_from(req.num_prompt_tokens)
        return self.allocate_slots(req, req.num_prompt_tokens)

    def allocate_slots(self, req: Request, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(req.num_computed_tokens + num_new_tokens)
        if not req.window_tables:
            req.window_tables = [[] for _ in self.windows]
        firsts = [g.first_block(req.num_computed_tokens, req.window_from) for g in self.windows]
        for group, table, first in zip(self.windows, req.window_tables, firsts):
            for i in range(min(first, len(table))):
                group.release(table, i)  # behind the window: back to the pool at once
            if group.missing(table, first, needed) > len(group.free_ids):
                return False
        if not super().allocate_slots(req, num_new_tokens):
            return False
        for group, table, first in zip(self.windows, req.window_tables, firsts):
            group.cover(table, first, needed)
        return True

    def free(self, req: Request) -> None:
        super().free(req)
        for group, table in zip(self.windows, req.window_tables):
            group.trim(table, 0)
        req.window_tables = []
        req.cached_until = req.window_from = 0

    def trim(self, req: Request, num_tokens: int) -> None:
        super().trim(req, num_tokens)
        for group, table in zip(self.windows, req.window_tables):
            group.trim(table, self.blocks_needed(num_tokens))

    def window_blocks_in_use(self) -> list[int]:
        """Each sliding group's blocks held by requests."""
        return [g.num_blocks - len(g.free_ids) for g in self.windows]

    def window_pool_blocks(self) -> list[int]:
        return [g.num_blocks for g in self.windows]
