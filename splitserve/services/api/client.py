"""The API server's side of the worker sockets.

One PUSH socket per worker carries GenerateRequest/AbortRequest; one PULL socket, connected
to every worker, brings OutputBatch and WorkerStats back. A reader task routes each delta to
the RequestGroup that owns the request. Nothing here runs model code.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import zmq
import zmq.asyncio

from splitserve.engine.request import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.metrics import Metrics

HEARTBEAT_TIMEOUT_S = 15.0


class QueueFullError(Exception):
    """The admission bound is reached; the caller should retry later."""


class EngineRequestError(Exception):
    """A worker refused a request; the message says why."""


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    request_addr: str
    output_addr: str


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    worker: int
    start: float
    first_token: bool = False


@dataclass
class _Worker:
    endpoint: WorkerEndpoint
    socket: zmq.Socket
    last_stats: msg.WorkerStats | None = None
    last_seen: float = field(default=-1e9)
    inflight: int = 0


class WorkerClient:
    def __init__(self, endpoints: Sequence[WorkerEndpoint], max_queue: int, metrics: Metrics):
        self.max_queue = max_queue
        self.metrics = metrics
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._workers = [_Worker(e, self._push_socket(e.request_addr)) for e in endpoints]
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

    @property
    def num_ready(self) -> int:
        """Workers that sent a heartbeat recently."""
        now = time.monotonic()
        return sum(1 for w in self._workers if now - w.last_seen < HEARTBEAT_TIMEOUT_S)

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
        worker = min(range(len(self._workers)), key=lambda i: self._workers[i].inflight)
        group = RequestGroup(self, [request_id for request_id, _, _ in requests])
        now = time.monotonic()
        for index, (request_id, prompt_ids, params) in enumerate(requests):
            self._tracked[request_id] = _Tracked(group, index, worker, now)
            self._workers[worker].inflight += 1
            self._send(worker, msg.GenerateRequest(request_id, prompt_ids, params))
        return group

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests that have not finished; their workers free the KV blocks."""
        by_worker: dict[int, list[str]] = {}
        for request_id in request_ids:
            tracked = self._untrack(request_id)
            if tracked is not None:
                by_worker.setdefault(tracked.worker, []).append(request_id)
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
        while True:
            message = msg.decode(await self._pull.recv())
            if isinstance(message, msg.WorkerStats):
                self._on_stats(message)
            elif isinstance(message, msg.OutputBatch):
                for delta in message.deltas:
                    self._on_delta(delta)
                for error in message.errors:
                    self._on_error(error)

    def _on_stats(self, stats: msg.WorkerStats) -> None:
        for worker in self._workers:
            if worker.endpoint.worker_id == stats.worker_id:
                worker.last_stats = stats
                worker.last_seen = time.monotonic()
        self.metrics.set_worker_stats(w.last_stats for w in self._workers if w.last_stats)
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
            tracked.group.queue.put_nowait((tracked.index, error))


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
            raise EngineRequestError(item.message)
        if item.finish_reason is not None:
            self._open -= 1
        return index, item

    def close(self) -> None:
        self.client.abort(self.request_ids)
