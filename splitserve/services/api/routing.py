"""Where the exchange sends a request: the router's decision (router/router.py, a pure
function) on the pools as the API server sees them now, and the prefix index's answer."""

from __future__ import annotations

import time

from splitserve.router.policy import Candidate
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import NoWorkerError, Pools, Route, Router, RouteRequest
from splitserve.services.api.images import PromptImages
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import WorkerState
from splitserve.services.metrics import Metrics


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

    def route(
        self, request_id: str, prompt_ids: list[int], images: PromptImages | None
    ) -> tuple[Route, dict[str, WorkerState]]:
        """The router's decision on the pools as they are now, and the workers by id
        (router.NoWorkerError if a pool the request needs has no routable worker)."""
        decodes = self.pool.routable("decode", "both")
        prefills = self.pool.routable("prefill")
        if not prefills and self.pool.count("prefill"):
            # Disaggregated, with every prefill worker failed or draining: a decode worker
            # cannot compute a prompt (the router would send it one as if colocated).
            raise NoWorkerError("prefill")
        visions = self.pool.routable("vision") if images is not None else []
        hashes = None if images is None else [image.image_hash for image in images.data]
        cached = self._cached(prompt_ids, prefills or decodes)
        request = RouteRequest(request_id, prompt_ids, self.block_size, cached, hashes)
        now = time.monotonic()
        pools = Pools(*(self._view(ws, now) for ws in (decodes, prefills, visions)))
        route = self.router.route(request, pools)
        self._count_decision(route)
        return route, {w.worker_id: w for w in decodes + prefills + visions}

    def _view(self, workers: list[WorkerState], now: float) -> list[Candidate]:
        timeout = self.pool.heartbeat_timeout_s
        return [w.candidate(now, timeout) for w in workers]

    def _cached(self, prompt_ids: list[int], workers: list[WorkerState]) -> dict[str, int]:
        """The prefix index's answer for the prompt, when the router has a use for it, hashed
        from the root the workers that compute prompts report (none while they disagree)."""
        if self.prefix is None or not self.router.wants_prefix(self.pool.count("prefill")):
            return {}
        roots = {w.last_stats.hash_root for w in workers if w.last_stats is not None}
        if len(roots) != 1:
            return {}
        return self.prefix.cached_blocks(prompt_ids, roots.pop())

    def _count_decision(self, route: Route) -> None:
        m, router = self.metrics, self.router
        if route.prefill is not None:
            m.router_decisions.labels(m.model_name, router.prefill_policy.name, "prefill").inc()
        m.router_decisions.labels(m.model_name, router.decode_policy.name, "decode").inc()
