"""Where the exchange sends a request: the router's decision (router/router.py, a pure
function) on the pools as the API server sees them now, and the prefix index's answer.

The index is asked (``cached``) before a request is routed, off the event loop when it is
remote (router/prefix_lookup.py), so ``route`` itself never waits on Redis.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from splitserve.router.policy import Candidate
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import NoWorkerError, Pools, Route, Router, RouteRequest
from splitserve.services.api.images import PromptImages
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import WorkerState
from splitserve.services.metrics import API_POOL, Metrics


class Routing:
    def __init__(
        self,
        pool: WorkerPool,
        metrics: Metrics,
        router: Router,
        block_size: int,
        prefix: PrefixLookup | None,
    ) -> None:
        """prefix: the prefix index lookup that routing uses (None: load only)."""
        self.pool = pool
        self.metrics = metrics
        self.router = router
        self.block_size = block_size
        self.prefix = prefix
        self._malformed = 0
        """The index's malformed entries already counted in the metric."""

    def route(
        self,
        request_id: str,
        prompt_ids: list[int],
        images: PromptImages | None,
        cached: Mapping[str, int],
    ) -> tuple[Route, dict[str, WorkerState]]:
        """The router's decision on the pools as they are now, and the workers by id
        (router.NoWorkerError if a pool the request needs has no routable worker).
        cached: the prefix index's answer for the prompt (``cached``; empty: by load)."""
        decodes = self.pool.routable("decode", "both")
        prefills = self.pool.routable("prefill")
        if not prefills and self.pool.count("prefill"):
            # Disaggregated, with every prefill worker failed or draining: a decode worker
            # cannot compute a prompt (the router would send it one as if colocated).
            raise NoWorkerError("prefill")
        visions = self.pool.routable("vision") if images is not None else []
        hashes = None if images is None else [image.image_hash for image in images.data]
        request = RouteRequest(request_id, prompt_ids, self.block_size, cached, hashes)
        now = time.monotonic()
        pools = Pools(*(self._view(ws, now) for ws in (decodes, prefills, visions)))
        route = self.router.route(request, pools)
        self._count_decision(route)
        return route, {w.worker_id: w for w in decodes + prefills + visions}

    def _view(self, workers: list[WorkerState], now: float) -> list[Candidate]:
        timeout = self.pool.heartbeat_timeout_s
        return [w.candidate(now, timeout) for w in workers]

    async def cached(self, prompts: list[list[int]]) -> list[dict[str, int]] | None:
        """The prefix index's answer for each prompt, when the router has a use for it,
        hashed from the root the workers that compute prompts report (none while they
        disagree); None without one, or when the index did not answer in time (counted)."""
        if self.prefix is None or not self.router.wants_prefix(self.pool.count("prefill")):
            return None
        workers = self.pool.routable("prefill") or self.pool.routable("decode", "both")
        roots = {w.last_stats.hash_root for w in workers if w.last_stats is not None}
        if len(roots) != 1:
            return None
        answers = await self.prefix.answers(prompts, roots.pop())
        api = self.metrics.labels(API_POOL, API_POOL)
        if answers is None:
            self.metrics.prefix_lookup_timeouts.labels(*api).inc()
        malformed = self.prefix.index.malformed_entries
        if malformed > self._malformed:
            self.metrics.prefix_index_malformed.labels(*api).inc(malformed - self._malformed)
            self._malformed = malformed
        return answers

    def _count_decision(self, route: Route) -> None:
        m, router = self.metrics, self.router
        if route.prefill is not None:
            m.router_decisions.labels(m.model_name, router.prefill_policy.name, "prefill").inc()
        m.router_decisions.labels(m.model_name, router.decode_policy.name, "decode").inc()
