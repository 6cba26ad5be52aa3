"""The API server's request exchange: admission, the hops of each request, the output reader.

``admit`` asks the prefix index about the prompts (off the event loop when the index is
remote: router/prefix_lookup.py) and hands its answers to ``submit``, which admits one API
request's engine requests as a RequestGroup (QueueFullError past
``max_queue``), asks the router where each goes (router/router.py, a pure decision from the
prefix index's answer and the pool's loads) and sends them. Colocated workers get a
GenerateRequest. Disaggregated requests take two hops: Reserve to the decode worker, and,
once it answers Reserved, Prefill to the prefill worker (reserve first, so that blocks exist
before any compute is spent); an image prompt's images go to a vision worker, which sends the
embeddings to the prefill worker.

One reader task takes every message the workers send: deltas and errors go to the group that
owns the request, WorkerStats to the pool (heartbeats), IndexUpdate to the prefix lookup,
WorkerFailed fails every request waiting on that worker. A message that does not decode, or
whose handling raises, is logged and dropped, and the request it concerns fails (500) instead
of waiting forever; the reader goes on. Once a second it fails the requests waiting on a
worker whose heartbeat stopped. Nothing here runs model code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.policy import Candidate
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import Pools, Route, Router, RouteRequest
from splitserve.services import messages as msg
from splitserve.services.api.images import PromptImages
from splitserve.services.api.inflight import InFlight
from splitserve.services.api.request_group import QueueFullError, RequestGroup
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import Tracked, WorkerState
from splitserve.services.metrics import API_POOL, Metrics

SWEEP_INTERVAL_S = 1.0

log = logging.getLogger("splitserve.api")


class RequestExchange:
    def __init__(
        self,
        pool: WorkerPool,
        max_queue: int,
        metrics: Metrics,
        router: Router | None = None,
        block_size: int = 16,
        prefix: PrefixLookup | None = None,
    ) -> None:
        """prefix: the prefix index lookup that routing uses (None: load only)."""
        self.pool = pool
        self.max_queue = max_queue
        self.metrics = metrics
        self.router = router or Router()
        self.block_size = block_size
        self.prefix = prefix
        self.inflight = InFlight(metrics)
        self._reader: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start reading worker output; call from the server's event loop."""
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        """Stop the reader and close the pool's sockets."""
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.pool.close()
        if self.prefix is not None:
            self.prefix.close()

    @property
    def num_admitted(self) -> int:
        return len(self.inflight)

    async def admit(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        traffic_class: str | None = None,
        images: PromptImages | None = None,
    ) -> RequestGroup:
        """``submit``, with the prefix index's answers for the prompts asked first."""
        cached = await self._cached([prompt_ids for _, prompt_ids, _ in requests])
        return self.submit(requests, traffic_class, images, cached)

    def submit(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        traffic_class: str | None = None,
        images: PromptImages | None = None,
        cached: Sequence[dict[str, int]] | None = None,
    ) -> RequestGroup:
        """Admit engine requests as one group (one API request); QueueFullError if over
        bound, router.NoWorkerError (before any is sent) if a pool they need is empty.

        traffic_class: the retention class of the blocks its prompts leave in block stores.
        images: the images of the prompt (every request of the group has the same prompt);
        a vision worker encodes them for each request's prefill worker. cached: the prefix
        index's answer for each request's prompt (None: routed by load alone)."""
        if len(self.inflight) + len(requests) > self.max_queue:
            raise QueueFullError(f"the server is at its admission bound of {self.max_queue}")
        group = RequestGroup([request_id for request_id, _, _ in requests], self.abort)
        try:
            for index, (request_id, prompt_ids, params) in enumerate(requests):
                blocks = cached[index] if cached is not None else {}
                self._admit(
                    group, index, (request_id, prompt_ids, params), traffic_class, images, blocks
                )
        except BaseException:
            # NOTE: a request admitted before the failure (or the one whose send raised, for
            # example a message that does not encode) would hold its slot for ever.
            group.close()
            raise
        return group

    def _admit(
        self,
        group: RequestGroup,
        index: int,
        request: tuple[str, list[int], SamplingParams],
        traffic_class: str | None,
        images: PromptImages | None,
        cached: dict[str, int],
    ) -> None:
        request_id, prompt_ids, params = request
        now = time.monotonic()
        route, workers = self._route(request_id, prompt_ids, images, now, cached)
        decode = workers[route.decode]
        tracked = Tracked(group, index, decode, now)
        self.inflight.add(request_id, tracked, -(-len(prompt_ids) // self.block_size))
        if route.prefill is None:
            generate = msg.GenerateRequest(request_id, prompt_ids, params, traffic_class)
            self.pool.send(decode, generate)
            self.inflight.prompt_sent(tracked)
            return
        prefill = workers[route.prefill]
        self.inflight.add_prefill(tracked, prefill, route.prefill_tokens)
        spans = images.spans if images is not None else []
        peer = None
        if route.peer is not None:
            address = workers[route.peer.worker_id].endpoint.request_addr
            peer = msg.PeerPrefix(route.peer.worker_id, address, route.peer.blocks)
        kv_addr = decode.endpoint.kv_addr
        tracked.pending_prefill = msg.Prefill(
            request_id, prompt_ids, params, decode.worker_id, kv_addr, traffic_class, spans, peer
        )
        if route.vision is not None and images is not None:
            self._encode(tracked, workers[route.vision], request_id, images)
        reserve = msg.Reserve(request_id, prompt_ids, params, prefill.worker_id, spans)
        self.pool.send(decode, reserve)

    def _route(
        self,
        request_id: str,
        prompt_ids: list[int],
        images: PromptImages | None,
        now: float,
        cached: dict[str, int],
    ) -> tuple[Route, dict[str, WorkerState]]:
        """The router's decision on the pools as they are now, and the workers by id."""
        decodes = self.pool.routable("decode", "both")
        prefills = self.pool.routable("prefill")
        visions = self.pool.routable("vision") if images is not None else []
        hashes = None if images is None else [image.image_hash for image in images.data]
        request = RouteRequest(request_id, prompt_ids, self.block_size, cached, hashes)
        pools = Pools(*(self._view(ws, now) for ws in (decodes, prefills, visions)))
        route = self.router.route(request, pools)
        self._count_decision(route)
        return route, {w.worker_id: w for w in decodes + prefills + visions}

    def _view(self, workers: list[WorkerState], now: float) -> list[Candidate]:
        timeout = self.pool.heartbeat_timeout_s
        return [w.candidate(now, timeout) for w in workers]

    async def _cached(self, prompts: list[list[int]]) -> list[dict[str, int]] | None:
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
        if answers is None:
            api = self.metrics.labels(API_POOL, API_POOL)
            self.metrics.prefix_lookup_timeouts.labels(*api).inc()
        return answers

    def _encode(
        self, tracked: Tracked, vision: WorkerState, request_id: str, images: PromptImages
    ) -> None:
        """Send the images to a vision worker, which sends the embeddings to the prefill
        worker while the decode worker reserves blocks."""
        assert tracked.prefill is not None
        self.inflight.add_vision(tracked, vision)
        prefill = tracked.prefill.endpoint
        message = msg.EncodeImages(request_id, images.data, prefill.worker_id, prefill.kv_addr)
        self.pool.send(vision, message)

    def _count_decision(self, route: Route) -> None:
        m, router = self.metrics, self.router
        if route.prefill is not None:
            m.router_decisions.labels(m.model_name, router.prefill_policy.name, "prefill").inc()
        m.router_decisions.labels(m.model_name, router.decode_policy.name, "decode").inc()

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests that have not finished; their workers free the KV blocks."""
        by_worker: dict[WorkerState, list[str]] = {}
        for request_id in request_ids:
            tracked = self.inflight.get(request_id)
            if tracked is None:
                continue
            vision = tracked.vision  # before remove(), which ends the prompt's hops
            self.inflight.remove(request_id, "abort")
            by_worker.setdefault(tracked.worker, []).append(request_id)
            if tracked.prefill is not None and tracked.pending_prefill is None:
                by_worker.setdefault(tracked.prefill, []).append(request_id)
            if vision is not None:
                by_worker.setdefault(vision, []).append(request_id)
        for worker, ids in by_worker.items():
            self.pool.send(worker, msg.AbortRequest(ids))

    async def _read_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            data = await self.pool.receive(SWEEP_INTERVAL_S)
            if data is not None:
                self._handle(data)
            if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
                last_sweep = time.monotonic()
                self._guarded(None, self._fail_lost_requests)

    def _handle(self, data: bytes) -> None:
        try:
            message = msg.decode(data)
        except ValueError:
            log.exception("dropped a worker message that does not decode")
            return
        if isinstance(message, msg.OutputBatch):
            for delta in message.deltas:
                self._guarded(delta.request_id, partial(self._on_delta, delta))
            for error in message.errors:
                self._guarded(error.request_id, partial(self._on_error, error, ""))
        elif isinstance(message, msg.Reserved):
            self._guarded(message.request_id, partial(self._on_reserved, message))
        elif isinstance(message, msg.WorkerStats):
            self._guarded(None, partial(self.pool.on_stats, message))
        elif isinstance(message, msg.Heartbeat):
            self._guarded(None, partial(self.pool.on_heartbeat, message))
        elif isinstance(message, msg.IndexUpdate) and self.prefix is not None:
            u = message
            self._guarded(
                None, partial(self.prefix.apply, u.holder, u.tier, u.stored, u.evicted, u.rebuild)
            )
        elif isinstance(message, msg.WorkerFailed):
            self._guarded(None, partial(self._on_worker_failed, message))

    def _guarded(self, request_id: str | None, handle: Callable[[], None]) -> None:
        """Run one handler; an exception is logged, and the request it concerns (if any)
        fails with a 500 instead of waiting for output that will never reach it."""
        tracked = self.inflight.get(request_id) if request_id is not None else None
        try:
            handle()
        except Exception as exc:
            log.exception("handling a worker message failed (request %s)", request_id)
            if tracked is not None and request_id is not None:
                self._fail_broken(request_id, tracked, exc)

    def _fail_broken(self, request_id: str, tracked: Tracked, exc: Exception) -> None:
        text = f"the API server failed handling this request's output: {exc!r}"
        tracked.group.queue.put_nowait((tracked.index, msg.RequestError(request_id, text, 500)))
        try:
            self._release(request_id, "internal_error")
        except Exception:
            log.exception("releasing request %s after that failure failed", request_id)

    def _on_reserved(self, reserved: msg.Reserved) -> None:
        tracked = self.inflight.get(reserved.request_id)
        if tracked is None or tracked.pending_prefill is None or tracked.prefill is None:
            return
        self.pool.send(tracked.prefill, tracked.pending_prefill)
        tracked.pending_prefill = None
        self.inflight.prompt_sent(tracked)

    def _on_worker_failed(self, failed: msg.WorkerFailed) -> None:
        worker = self.pool.mark_failed(failed.worker_id, failed.reason)
        if worker is not None:
            why = f"worker {failed.worker_id} failed: {failed.reason}"
            self._fail_waiting([worker], lambda _: why, "worker_failed")

    def _fail_lost_requests(self) -> None:
        """Requests waiting on a worker whose heartbeat stopped get an error."""
        lost = self.pool.lost(time.monotonic())
        self._fail_waiting(
            lost, lambda w: f"worker {w.worker_id} stopped responding", "worker_lost"
        )
        self.pool.count_workers()

    def _fail_waiting(
        self, workers: list[WorkerState], why: Callable[[WorkerState], str], reason: str
    ) -> None:
        """Every tracked request that waits on one of ``workers`` fails with a 503."""
        for request_id, stopped in self.inflight.waiting_on(workers):
            error = msg.RequestError(request_id, why(stopped), 503)
            self._guarded(request_id, partial(self._on_error, error, reason))

    def _on_delta(self, delta: msg.TokenDelta) -> None:
        tracked = self.inflight.on_delta(delta)
        if tracked is not None:
            tracked.group.queue.put_nowait((tracked.index, delta))

    def _on_error(self, error: msg.RequestError, reason: str) -> None:
        """The request fails with ``error``; reason labels the failure metric ("" : by status)."""
        tracked = self.inflight.get(error.request_id)
        if tracked is None:
            return
        # The group hears first, so that it gets the error even if the clean-up below fails.
        tracked.group.queue.put_nowait((tracked.index, error))
        failure = reason or ("invalid_request" if error.status == 400 else "request_failed")
        self._release(error.request_id, failure)

    def _release(self, request_id: str, reason: str) -> None:
        """Stop tracking a failed request and make sure its other hop frees what it holds."""
        tracked = self.inflight.remove(request_id, reason)
        if tracked is None or tracked.prefill is None:
            return
        targets = [tracked.worker]
        if tracked.pending_prefill is None:
            targets.append(tracked.prefill)
        for worker in targets:
            self.pool.send(worker, msg.AbortRequest([request_id]))
