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
owns the request, WorkerStats to the pool (heartbeats), IndexUpdate to the prefix lookup.
A worker that stops (WorkerFailed, its process died: ``worker_stopped``; once a second, those
whose heartbeat stopped) no longer takes requests, and every request waiting on it migrates
to the workers left (migration.py), waits for one to come back (holds.py) or fails with a
503. Every request has a deadline (``request_timeout_s``): past it, the sweep fails it with a
504 and aborts it on its workers. A message that does not decode, or
whose handling raises, is logged and dropped, and the request it concerns fails (500) instead
of waiting forever; the reader goes on. Nothing here runs model code.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from functools import partial

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import NoWorkerError, Route, Router
from splitserve.services import messages as msg
from splitserve.services.api.holds import Holds
from splitserve.services.api.images import PromptImages
from splitserve.services.api.inflight import InFlight
from splitserve.services.api.migration import Migrations, Outcome, Submission, as_original
from splitserve.services.api.request_group import QueueFullError, RequestGroup
from splitserve.services.api.routing import Routing
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import Tracked, WorkerEndpoint, WorkerState
from splitserve.services.metrics import Metrics

SWEEP_INTERVAL_S = 1.0
READ_RETRY_S = 0.01
HOLD_POLL_S = 0.05
REQUEST_TIMEOUT_S = 600.0
RESTART_WAIT_S = 30.0

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
        migration_limit: int = 3,
        request_timeout_s: float = REQUEST_TIMEOUT_S,
        restart_wait_s: float = RESTART_WAIT_S,
    ) -> None:
        """prefix: the prefix index lookup that routing uses (None: load only).
        migration_limit: how often a request may move off a worker that stopped.
        request_timeout_s: every request's deadline from its admission. restart_wait_s: how
        long a request waits for a stopped worker's pool to have one again (holds.py)."""
        self.pool = pool
        self.max_queue = max_queue
        self.metrics = metrics
        self.routing = Routing(pool, metrics, router or Router(), block_size, prefix)
        self.prefix = prefix
        self.block_size = block_size
        self.inflight = InFlight(metrics)
        self.migrations = Migrations(
            migration_limit, metrics, pool, self.inflight, self.routing, self._send
        )
        self.request_timeout_s = request_timeout_s
        self.holds = Holds(restart_wait_s)
        self.on_worker_failed: Callable[[str], None] | None = None
        """Told the id of a worker that sent WorkerFailed (its supervisor restarts it)."""
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
        """``submit``, with the prefix index's answers for the prompts asked first; while a
        pool it needs is empty because its workers stopped, it waits for a restart (up to
        restart_wait_s) before the NoWorkerError."""
        cached = await self.routing.cached([prompt_ids for _, prompt_ids, _ in requests])
        since = time.monotonic()
        while True:
            try:
                return self.submit(requests, traffic_class, images, cached)
            except NoWorkerError:
                waited = time.monotonic() - since
                if waited >= self.holds.wait_s or not self.pool.restarting():
                    raise
            await asyncio.sleep(HOLD_POLL_S)

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
                submission = Submission(prompt_ids, params, traffic_class, images)
                blocks = cached[index] if cached is not None else {}
                route, workers = self.routing.route(request_id, prompt_ids, images, blocks)
                decode = workers[route.decode]
                now = time.monotonic()
                tracked = Tracked(group, index, decode, now, request_id=request_id)
                tracked.submission = submission
                tracked.deadline = now + self.request_timeout_s
                self._send(request_id, tracked, submission, route, workers)
        except BaseException:
            # NOTE: a request admitted before the failure (or the one whose send raised, for
            # example a message that does not encode) would hold its slot for ever.
            group.close()
            raise
        return group

    def _send(
        self,
        request_id: str,
        tracked: Tracked,
        sub: Submission,
        route: Route,
        workers: dict[str, WorkerState],
    ) -> None:
        """Track an attempt of a request and send its first hop (or its only one)."""
        decode, prompt_ids, params = tracked.worker, sub.prompt_ids, sub.params
        self.inflight.add(request_id, tracked, -(-len(prompt_ids) // self.block_size))
        if route.prefill is None:
            resumed = sub.resumed, sub.resumed_chars
            generate = msg.GenerateRequest(
                request_id, prompt_ids, params, sub.traffic_class, *resumed
            )
            self.pool.send(decode, generate)
            self.inflight.prompt_sent(tracked)
            return
        prefill = workers[route.prefill]
        self.inflight.add_prefill(tracked, prefill, route.prefill_tokens)
        spans = sub.images.spans if sub.images is not None else []
        peer = None
        if route.peer is not None:
            address = workers[route.peer.worker_id].endpoint.request_addr
            peer = msg.PeerPrefix(route.peer.worker_id, address, route.peer.blocks)
        kv_addr = decode.endpoint.kv_addr
        tracked.pending_prefill = msg.Prefill(
            request_id,
            prompt_ids,
            params,
            decode.worker_id,
            kv_addr,
            sub.traffic_class,
            spans,
            peer,
            sub.resumed,
        )
        if route.vision is not None and sub.images is not None:
            self._encode(tracked, workers[route.vision], request_id, sub.images)
        reserve = msg.Reserve(
            request_id, prompt_ids, params, prefill.worker_id, spans, sub.resumed, sub.resumed_chars
        )
        self.pool.send(decode, reserve)

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

    def abort(self, request_ids: Sequence[str], reason: str = "abort") -> None:
        """Stop requests that have not finished; their workers free the KV blocks."""
        by_worker: dict[WorkerState, list[str]] = {}
        for original_id in request_ids:
            request_id = self.migrations.current(original_id)
            self.migrations.forget(original_id)
            tracked = self.inflight.get(request_id)
            if tracked is None:
                continue
            hops = tracked.hops()  # before remove(), which ends the prompt's hops
            self.inflight.remove(request_id, reason)
            for worker in hops:
                by_worker.setdefault(worker, []).append(request_id)
        for worker, ids in by_worker.items():
            self.pool.send(worker, msg.AbortRequest(ids))

    async def _read_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            try:
                data = await self.pool.receive(SWEEP_INTERVAL_S)
                if data is not None:
                    self._handle(data)
            except Exception:  # the reader outlives any one failure (its requests: _guarded)
                log.exception("reading worker output failed; the reader goes on")
                await asyncio.sleep(READ_RETRY_S)
            if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
                last_sweep = time.monotonic()
                self._guarded(None, self._fail_lost_requests)
                self._guarded(None, self._retry_held)
                self._guarded(None, self._expire_overdue)

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
                self._guarded(error.request_id, partial(self._on_worker_error, error))
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
        self.worker_stopped(failed.worker_id, failed.reason, "worker_failed")
        if self.on_worker_failed is not None:
            self.on_worker_failed(failed.worker_id)

    def worker_stopped(self, worker_id: str, why: str, reason: str = "worker_died") -> None:
        """A worker stopped for good (it said so, or its process died): it takes no new
        requests, and those waiting on it migrate (or fail with a 503)."""
        worker = self.pool.mark_failed(worker_id, why)
        if worker is None:
            return
        # Its expert-parallel group leaves the pool whole before any request moves.
        stopped = [worker, *self.pool.fail_group(worker)]
        self._fail_waiting(stopped, lambda w: f"worker {w.worker_id} failed: {w.failed}", reason)

    def rejoin(self, endpoint: WorkerEndpoint) -> None:
        """A stopped worker runs again (restarted): route to it under its id from now on."""
        self.pool.replace(endpoint)

    def _fail_lost_requests(self) -> None:
        """Requests waiting on a worker whose heartbeat stopped migrate or get an error."""
        lost = self.pool.lost(time.monotonic())
        self._fail_waiting(
            lost, lambda w: f"worker {w.worker_id} stopped responding", "worker_lost"
        )
        self.pool.count_workers()

    def _retry_held(self) -> None:
        for held in self.holds.all():
            retry = partial(self._migrate_or_fail, held.error, held.stopped, held.reason)
            self._guarded(held.error.request_id, retry)

    def _expire_overdue(self) -> None:
        """Requests past their deadline fail with a 504 and leave their workers."""
        for request_id, tracked in self.inflight.overdue(time.monotonic()):
            text = f"the request did not finish within {self.request_timeout_s:g} s (the deadline)"
            tracked.group.queue.put_nowait((tracked.index, msg.RequestError(request_id, text, 504)))
            self.abort([tracked.request_id], "deadline")

    def _fail_waiting(
        self, workers: list[WorkerState], why: Callable[[WorkerState], str], reason: str
    ) -> None:
        """Every tracked request that waits on one of ``workers`` migrates to the workers
        left (migration.py) or, past its limit or with none left, fails with a 503."""
        for request_id, stopped in self.inflight.waiting_on(workers):
            error = msg.RequestError(request_id, why(stopped), 503)
            self._guarded(request_id, partial(self._migrate_or_fail, error, stopped, reason))

    def _on_worker_error(self, error: msg.RequestError) -> None:
        """A worker failed a request: a 503 (the service failed it: a transfer, a peer that
        stopped) migrates like a request on a stopped worker; any other status is final."""
        if error.status == 503:
            self._migrate_or_fail(error, None, "request_failed")
        else:
            self._on_error(error, "")

    def _migrate_or_fail(
        self, error: msg.RequestError, stopped: WorkerState | None, reason: str
    ) -> None:
        outcome = self.migrations.migrate(error.request_id, stopped, reason)
        if outcome is Outcome.WAIT and self.holds.keep(error, stopped, reason):
            return
        first = self.holds.release(error.request_id) or error
        if outcome is not Outcome.MOVED:
            self._on_error(first, reason)

    def _on_delta(self, delta: msg.TokenDelta) -> None:
        tracked = self.inflight.get(delta.request_id)
        if tracked is not None:
            delta = as_original(tracked, delta)
        tracked = self.inflight.on_delta(delta)
        if tracked is not None:
            tracked.token_ids += delta.token_ids
            tracked.text_chars += len(delta.text)
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
