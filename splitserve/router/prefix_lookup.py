"""The router's view of the prefix index: how many leading blocks of a prompt each holder has.

Hashes come from kvstore/hashing.py with the engine's block size and the hash root that the
workers report, so they name the same blocks as the workers' block managers and stores. With
a ``memory://`` index the index lives here and the workers' ``IndexUpdate`` messages are
applied to it; with Redis the workers publish directly and this only reads. An unreachable
index answers nothing, so routing falls back to load only.

The API server asks through ``answers``, on its event loop: an in-process index answers there
at once; a remote one (Redis) is asked on a thread of this lookup's own, and an answer that
takes longer than ``wait_s`` is given up (None: route by load), so a hung or partitioned
Redis never stalls the loop that streams every other request's tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.index import MemoryPrefixIndex, PrefixIndex
from splitserve.router.policy import Candidate

WAIT_S = 0.1
"""How long a request waits for a remote index's answer before it is routed by load."""
THREADS = 4


class PrefixLookup:
    def __init__(self, index: PrefixIndex, block_size: int, wait_s: float = WAIT_S) -> None:
        self.index = index
        self.block_size = block_size
        self.wait_s = wait_s
        remote = not isinstance(index, MemoryPrefixIndex)
        self._threads = ThreadPoolExecutor(THREADS, "prefix-lookup") if remote else None

    async def answers(
        self, prompts: Sequence[Sequence[int]], root: int
    ) -> list[dict[str, int]] | None:
        """``cached_blocks`` of each prompt, asked off the event loop when the index is
        remote; None when it did not answer within ``wait_s``."""
        if self._threads is None:
            return [self.cached_blocks(p, root) for p in prompts]
        loop = asyncio.get_running_loop()
        asked = loop.run_in_executor(
            self._threads, lambda: [self.cached_blocks(p, root) for p in prompts]
        )
        try:
            return await asyncio.wait_for(asked, self.wait_s)
        except TimeoutError:
            return None  # the thread finishes on its own: the index bounds its calls

    def cached_blocks(self, prompt_ids: Sequence[int], root: int) -> dict[str, int]:
        """Holder -> leading blocks of the prompt it has (in any tier); root: the hash chain's
        start of the workers asked about (kvstore/hashing.py: hash_root)."""
        hashes = block_hashes(prompt_ids, self.block_size, root)
        if not hashes:
            return {}
        return {
            holder: blocks for holder, (blocks, _) in self.index.longest_prefixes(hashes).items()
        }

    def apply(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int], rebuild: bool
    ) -> None:
        """A worker's update, for an index that lives in this process."""
        if rebuild:
            self.index.rebuild(holder, tier, stored)
        else:
            self.index.publish(holder, tier, stored, evicted)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        self.index.close()


def holds(cached_blocks: Mapping[str, int], worker: Candidate) -> int:
    """Leading blocks a worker can serve to a peer: its own tiers' (device, host) or its
    node's disk tier's, whichever is longer."""
    node = cached_blocks.get(worker.node_id, 0) if worker.node_id else 0
    return max(cached_blocks.get(worker.worker_id, 0), node)


def best_peer(
    cached_blocks: Mapping[str, int], have: int, peers: Iterable[str], usable: int
) -> tuple[str, int] | None:
    """The peer (a live prefill worker other than the chosen one) with the most leading
    blocks of the prompt, capped at ``usable``, when that is more than the ``have`` blocks
    the chosen worker and its node's store hold; None otherwise. Ties go to the earliest."""
    best: tuple[str, int] | None = None
    for peer in peers:
        blocks = min(cached_blocks.get(peer, 0), usable)
        if blocks > max(have, best[1] if best else 0):
            best = (peer, blocks)
    return best
