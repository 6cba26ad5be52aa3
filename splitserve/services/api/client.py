"""The API server's side of the worker sockets.

One PUSH socket per worker carries requests and aborts; one PULL socket, connected to every
worker, brings OutputBatch, Reserved and WorkerStats back. A reader task routes each delta
to the RequestGroup that owns the request. Nothing here runs model code.

Colocated workers get a GenerateRequest. Disaggregated requests take two hops: Reserve to
the decode worker the router chose, and, once it answers Reserved, Prefill to the prefill
worker (reserve first, so that blocks exist before any compute is spent).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from splitserve.engine.request import SamplingParams
from splitserve.router.policy import Candidate, RequestInfo
from splitserve.router.router import Router
from splitserve.services import messages as msg
from splitserve.services.metrics import Metrics

HEARTBEAT_TIMEOUT_S = 15.0
SWEEP_INTERVAL_S = 1.0


class QueueFullError(Exception):
    """The admission bound is reached; the caller should retry later."""


class EngineRequestError(Exception):
    """A worker refused or lost a request; the message says why.

    status: the HTTP status to answer with (400: the request itself is bad, 503: the service
    failed it, for example a KV transfer that did not complete).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    request_addr: str
    output_addr: str
    role: str = "both"
    kv_addr: str = ""


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    worker: int
    start: float
    prefill: int | None = None
    pending_prefill: msg.Prefill | None = None
    first_token: bool = False


@dataclass
class _Worker:
    endpoint: WorkerEndpoint
    socket: zmq.Socket
    last_stats: msg.WorkerStats | None = None
    last_seen: float = field(default=-1e9)
    inflight: int = 0
    blocks_since_stats: int = 0
    transfer_bytes: int = 0

    def healthy(self, now: float, timeout_s: float) -> bool:
        return now - self.last_seen < timeout_s

    def candidate(self, now: float, timeout_s: float) -> Candidate:
        stats = self.last_stats
        return Candidate(
            worker_id=self.endpoint.worker_id,
            num_free_blocks=(stats.num_free_blocks if stats else 0) - self.blocks_since_stats,
            num_running=stats.num_running if stats else 0,
            inflight=self.inflight,
            healthy=self.healthy(now, timeout_s),
        )


class WorkerClient:
    def __init__(
        self,
        endpoints: Sequence[WorkerEndpoint],
        max_queue: int,
        metrics: Metrics,
        router: Router | None = None,
        block_size: int = 16,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ):
        self.max_queue = max_queue
        self.metrics = metrics
        self.router = router or Router()
        self.block_size = block_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._workers = [_Worker(e, self._push_socket(e.request_addr)) for e in endpoints]
        self._prefill = [i for i, w in enumerate(self._workers) if w.endpoint.role == "prefill"]
        self._decode = [i for i, w in enumerate(self._workers) if w.endpoint.role != "prefill"]
        self._pull = self._async_ctx.socket(zmq.PULL)
        for endpoint in endpoints:
            self._pull.connect(endpoint.output_addr)
        self._tracked: dict[str, _Tracked] = {}
        self._reader: asyncio.Task[None] | None = None

    def _push_socket(self, addr: str) -> zmq.Socket:
        socket = self._sync_ctx.socket(zmq.PUSH)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(addr)
        return socket

    def start(self) -> None:
        """Start routing worker output; call from the server's event loop."""
        self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self._pull.close(linger=0)
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.term()

    def pools(self) -> dict[str, dict[str, int]]:
        """Per role: how many workers there are and how many sent a heartbeat recently."""
        now = time.monotonic()
        result: dict[str, dict[str, int]] = {}
        for w in self._workers:
            pool = result.setdefault(w.endpoint.role, {"replicas": 0, "ready": 0})
            pool["replicas"] += 1
            pool["ready"] += int(w.healthy(now, self.heartbeat_timeout_s))
        return result

    @property
    def num_ready(self) -> int:
        """Workers that sent a heartbeat recently."""
        return sum(p["ready"] for p in self.pools().values())

    @property
    def ready(self) -> bool:
        return self.num_ready == len(self._workers)

    @property
    def num_admitted(self) -> int:
        return len(self._tracked)

    def submit(self, requests: Sequence[tuple[str, list[int], SamplingParams]]) -> RequestGroup:
        """Admit engine requests as one group (one API request); QueueFullError if over bound."""
        if len(self._tracked) + len(requests) > self.max_queue:
            raise QueueFullError(f"the server is at its admission bound of {self.max_queue}")
        group = RequestGroup(self, [request_id for request_id, _, _ in requests])
        for index, (request_id, prompt_ids, params) in enumerate(requests):
            self._admit(group, index, request_id, prompt_ids, params)
        return group

    def _admit(
        self,
        group: RequestGroup,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
    ) -> None:
        now = time.monotonic()
        timeout = self.heartbeat_timeout_s
        plan = self.router.plan(
            RequestInfo(request_id, prompt_ids),
            [self._workers[i].candidate(now, timeout) for i in self._decode],
            [self._workers[i].candidate(now, timeout) for i in self._prefill],
        )
        decode = self._decode[plan.decode]
        tracked = _Tracked(group, index, decode, now)
        self._tracked[request_id] = tracked
        self._workers[decode].inflight += 1
        self._workers[decode].blocks_since_stats += -(-len(prompt_ids) // self.block_size)
        if plan.prefill is None:
            self._send(decode, msg.GenerateRequest(request_id, prompt_ids, params))
            return
        tracked.prefill = self._prefill[plan.prefill]
        d = self._workers[decode].endpoint
        prefill_id = self._workers[tracked.prefill].endpoint.worker_id
        tracked.pending_prefill = msg.Prefill(
            request_id, prompt_ids, params, d.worker_id, d.kv_addr
        )
        self._send(decode, msg.Reserve(request_id, prompt_ids, params, prefill_id))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests that have not finished; their workers free the KV blocks."""
        by_worker: dict[int, list[str]] = {}
        for request_id in request_ids:
            tracked = self._untrack(request_id)
            if tracked is None:
                continue
            by_worker.setdefault(tracked.worker, []).append(request_id)
            if tracked.prefill is not None and tracked.pending_prefill is None:
                by_worker.setdefault(tracked.prefill, []).append(request_id)
        for worker, ids in by_worker.items():
            self._send(worker, msg.AbortRequest(ids))

    def _send(self, worker: int, message: msg.Message) -> None:
        self._workers[worker].socket.send(msg.encode(message))
        self._count_admitted()

    def _untrack(self, request_id: str) -> _Tracked | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._workers[tracked.worker].inflight -= 1
            self._count_admitted()
        return tracked

    def _count_admitted(self) -> None:
        self.metrics.num_requests_admitted.labels(self.metrics.model_name).set(len(self._tracked))

    async def _read_loop(self) -> None:
        last_sweep = time.monotonic()
        while True:
            if await self._pull.poll(SWEEP_INTERVAL_S * 1000):
                self._on_message(msg.decode(await self._pull.recv()))
            if time.monotonic() - last_sweep >= SWEEP_INTERVAL_S:
                last_sweep = time.monotonic()
                self._fail_lost_requests()

    def _on_message(self, message: msg.Message) -> None:
        if isinstance(message, msg.WorkerStats):
            self._on_stats(message)
        elif isinstance(message, msg.Reserved):
            self._on_reserved(message)
        elif isinstance(message, msg.OutputBatch):
            for delta in message.deltas:
                self._on_delta(delta)
            for error in message.errors:
                self._on_error(error)

    def _on_reserved(self, reserved: msg.Reserved) -> None:
        tracked = self._tracked.get(reserved.request_id)
        if tracked is None or tracked.pending_prefill is None or tracked.prefill is None:
            return
        self._send(tracked.prefill, tracked.pending_prefill)
        tracked.pending_prefill = None

    def _on_stats(self, stats: msg.WorkerStats) -> None:
        worker = next(w for w in self._workers if w.endpoint.worker_id == stats.worker_id)
        worker.last_stats = stats
        worker.last_seen = time.monotonic()
        worker.blocks_since_stats = 0
        self.metrics.observe_transfers(stats, stats.kv_transfer_bytes - worker.transfer_bytes)
        worker.transfer_bytes = stats.kv_transfer_bytes
        self.metrics.set_worker_stats(w.last_stats for w in self._workers if w.last_stats)
        self.metrics.num_workers_ready.labels(self.metrics.model_name).set(self.num_ready)

    def _fail_lost_requests(self) -> None:
        """Requests waiting on a worker whose heartbeat stopped get an error."""
        now = time.monotonic()
        lost = {
            i
            for i, w in enumerate(self._workers)
            if w.last_stats is not None and not w.healthy(now, self.heartbeat_timeout_s)
        }
        for request_id, tracked in list(self._tracked.items()):
            waits_on = (
                {tracked.worker} if tracked.first_token else {tracked.worker, tracked.prefill}
            )
            stopped = lost & waits_on
            if stopped:
                name = self._workers[stopped.pop()].endpoint.worker_id
                error = f"worker {name} stopped responding"
                self._on_error(msg.RequestError(request_id, error, 503))
        self.metrics.num_workers_ready.labels(self.metrics.model_name).set(self.num_ready)

    def _on_delta(self, delta: msg.TokenDelta) -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:
            return
        m, name = self.metrics, self.metrics.model_name
        now = time.monotonic()
        if not tracked.first_token and delta.token_ids:
            tracked.first_token = True
            m.time_to_first_token.labels(name).observe(now - tracked.start)
        m.generation_tokens.labels(name).inc(len(delta.token_ids))
        if delta.finish_reason is not None:
            self._untrack(delta.request_id)
            m.prompt_tokens.labels(name).inc(delta.num_prompt_tokens)
            m.prefix_cache_hits.labels(name).inc(delta.num_cached_tokens)
            m.request_success.labels(name, delta.finish_reason).inc()
            m.e2e_request_latency.labels(name).observe(now - tracked.start)
        tracked.group.queue.put_nowait((tracked.index, delta))

    def _on_error(self, error: msg.RequestError) -> None:
        tracked = self._untrack(error.request_id)
        if tracked is not None:
            if tracked.prefill is not None:
                self.abort_elsewhere(tracked, error.request_id)
            tracked.group.queue.put_nowait((tracked.index, error))

    def abort_elsewhere(self, tracked: _Tracked, request_id: str) -> None:
        """After an error from one hop, make sure the other hop frees what it holds."""
        targets = {tracked.worker}
        if tracked.prefill is not None and tracked.pending_prefill is None:
            targets.add(tracked.prefill)
        for worker in targets:
            self._send(worker, msg.AbortRequest([request_id]))


class RequestGroup:
    """The engine requests of one API request (n choices x prompts), read through one queue.

    Iterating yields (index, TokenDelta) until every request finished; ``close`` aborts the
    ones still running, so call it in a ``finally``.
    """

    def __init__(self, client: WorkerClient, request_ids: list[str]) -> None:
        self.client = client
        self.request_ids = request_ids
        self.queue: asyncio.Queue[tuple[int, msg.TokenDelta | msg.RequestError]] = asyncio.Queue()
        self._open = len(request_ids)

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, msg.TokenDelta]:
        if self._open == 0:
            raise StopAsyncIteration
        index, item = await self.queue.get()
        if isinstance(item, msg.RequestError):
            raise EngineRequestError(item.message, item.status)
        if item.finish_reason is not None:
            self._open -= 1
        return index, item

    def close(self) -> None:
        self.client.abort(self.request_ids)
