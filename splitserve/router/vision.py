"""Which vision worker encodes a request's images.

Encoding is stateless except for each worker's encoder cache, so the choice is load first:
the fewest requests in flight (healthy workers before unhealthy ones). Among equally loaded
workers, the one that last took one of these images wins (its cache probably still holds the
embeddings), then the earliest. Concurrent requests spread over the pool; a repeated image
goes back to where it was encoded while that worker is no busier than the others.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from splitserve.router.policy import Candidate

MAX_REMEMBERED = 4096


class VisionRouter:
    def __init__(self, max_remembered: int = MAX_REMEMBERED) -> None:
        self.max_remembered = max_remembered
        self._last_worker: OrderedDict[str, str] = OrderedDict()
        """Image hash -> the worker that last took it, least recent first."""

    def choose(self, candidates: Sequence[Candidate], image_hashes: Sequence[str]) -> int:
        """Index of the chosen candidate (a non-empty list); remembers where the images go."""
        holders = {self._last_worker.get(h) for h in image_hashes}

        def key(index: int) -> tuple[bool, int, bool, int]:
            c = candidates[index]
            return (not c.healthy, c.inflight, c.worker_id not in holders, index)

        chosen = min(range(len(candidates)), key=key)
        for image_hash in image_hashes:
            self._last_worker[image_hash] = candidates[chosen].worker_id
            self._last_worker.move_to_end(image_hash)
        while len(self._last_worker) > self.max_remembered:
            self._last_worker.popitem(last=False)
        return chosen
