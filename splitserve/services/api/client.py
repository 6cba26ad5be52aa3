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
from collections.abc import Mapping, Sequence

import zmq
import zmq.asyncio

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.policy import RequestInfo
from splitserve.router.prefix_lookup import PrefixLookup, best_peer
from splitserve.router.router import Router
from splitserve.router.vision import VisionRouter
from splitserve.services import messages as msg
from splitserve.services.api.images import PromptImages
from splitserve.services.api.telemetry import RequestTelemetry
from splitserve.services.api.worker_view import Tracked, WorkerEndpoint, WorkerState, with_rates
from splitserve.services.metrics import API_POOL, Metrics

HEARTBEAT_TIMEOUT_S = 15.0
SWEEP_INTERVAL_S = 1.0
DRAIN_POLL_S = 0.05


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


class WorkerClient:
    def __init__(
        self,
        endpoints: Sequence[WorkerEndpoint],
        max_queue: int,
        metrics: Metrics,
        router: Router | None = None,
        block_size: int = 16,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
        prefix: PrefixLookup | None = None,
    ):
        """prefix: the prefix index lookup that cache-aware routing uses (None: load only)."""
        self.prefix = prefix
        self.max_queue = max_queue
        self.metrics = metrics
        self.router = router or Router()
        self.block_size = block_size
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._workers = [WorkerState(e, self._push_socket(e.request_addr)) for e in endpoints]
        self.telemetry = RequestTelemetry(metrics, self._workers)
        self._prefill = [i for i, w in enumerate(self._workers) if w.endpoint.role == "prefill"]
        self._decode = [
            i for i, w in enumerate(self._workers) if w.endpoint.role in ("decode", "both")
        ]
        self._vision = [i for i, w in enumerate(self._workers) if w.endpoint.role == "vision"]
        self.vision_router = VisionRouter()
        self._pull = self._async_ctx.socket(zmq.PULL)
        for endpoint in endpoints:
            self._pull.connect(endpoint.output_addr)
        self._tracked: dict[str, Tracked] = {}
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
        for w in self._live():
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
        return self.num_ready == len(self._live())

    def _live(self) -> list[WorkerState]:
        return [w for w in self._workers if not w.removed]

    def worker_ids(self, pool: str) -> list[str]:
        """The ids of a pool's workers that take new requests, oldest first."""
        return [w.endpoint.worker_id for w in self._workers if w.routable and w.pool == pool]

    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        """Route to a newly started worker from now on."""
        worker = WorkerState(endpoint, self._push_socket(endpoint.request_addr))
        self._workers.append(worker)
        index = len(self._workers) - 1
        self._role_indices(endpoint.role).append(index)
        self._pull.connect(endpoint.output_addr)
        self._count_workers()

    async def drain(self, worker_id: str) -> None:
        """Stop routing new requests to a worker and wait until its requests are done
        (a prefill worker's once their first token arrived, a decode worker's once they
        finished), then stop talking to it."""
        index, worker = self._find(worker_id)
        worker.draining = True
        self._count_workers()
        while any(self._waits_on(t, index) for t in self._tracked.values()):
            await asyncio.sleep(DRAIN_POLL_S)
        worker.removed = True
        worker.draining = False
        for indices in (self._prefill, self._decode, self._vision):
            if index in indices:
                indices.remove(index)
        worker.socket.close(linger=0)
        self._pull.disconnect(worker.endpoint.output_addr)
        self.metrics.forget_worker(worker.pool, worker_id)
        self._count_workers()

    def _role_indices(self, role: str) -> list[int]:
        return {"prefill": self._prefill, "vision": self._vision}.get(role, self._decode)

    def _find(self, worker_id: str) -> tuple[int, WorkerState]:
        for i, w in enumerate(self._workers):
            if w.endpoint.worker_id == worker_id and not w.removed:
                return i, w
        raise KeyError(worker_id)

    @staticmethod
    def _waits_on(tracked: Tracked, index: int) -> bool:
        return (
            tracked.worker == index
            or tracked.vision == index
            or (tracked.prefill == index and not tracked.first_token)
        )

    def _count_workers(self) -> None:
        now = time.monotonic()
        counts: dict[str, dict[str, int]] = {}
        for w in self._live():
            states = counts.setdefault(w.pool, {})
            state = w.state(now, self.heartbeat_timeout_s)
            states[state] = states.get(state, 0) + 1
        self.metrics.set_num_workers(counts)

    @property
    def num_admitted(self) -> int:
        return len(self._tracked)

    def submit(
        self,
        requests: Sequence[tuple[str, list[int], SamplingParams]],
        traffic_class: str | None = None,
        images: PromptImages | None = None,
    ) -> RequestGroup:
        """Admit engine requests as one group (one API request); QueueFullError if over bound.

        traffic_class: the retention class of the blocks its prompts leave in block stores.
        images: the images of the prompt (every request of the group has the same prompt);
        a vision worker encodes them for each request's prefill worker."""
        if len(self._tracked) + len(requests) > self.max_queue:
            raise QueueFullError(f"the server is at its admission bound of {self.max_queue}")
        group = RequestGroup(self, [request_id for request_id, _, _ in requests])
        for index, (request_id, prompt_ids, params) in enumerate(requests):
            self._admit(group, index, request_id, prompt_ids, params, traffic_class, images)
        return group

    def _admit(
        self,
        group: RequestGroup,
        index: int,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        traffic_class: str | None = None,
        images: PromptImages | None = None,
    ) -> None:
        now = time.monotonic()
        timeout = self.heartbeat_timeout_s
        decodes = [i for i in self._decode if self._workers[i].routable]
        prefills = [i for i in self._prefill if self._workers[i].routable]
        cached = self._cached(prompt_ids)
        peers = self._pullable(cached, prefills, now) if images is None else {}
        info = RequestInfo(request_id, prompt_ids, self.block_size, cached, peers)
        prefill_candidates = with_rates(
            [self._workers[i].candidate(now, timeout) for i in prefills]
        )
        plan = self.router.plan(
            info,
            [self._workers[i].candidate(now, timeout) for i in decodes],
            prefill_candidates,
        )
        self._count_decision(plan.prefill is not None)
        decode = decodes[plan.decode]
        tracked = Tracked(group, index, decode, now)
        self._tracked[request_id] = tracked
        self._workers[decode].inflight += 1
        self._workers[decode].blocks_since_stats += -(-len(prompt_ids) // self.block_size)
        if plan.prefill is None:
            self._send(decode, msg.GenerateRequest(request_id, prompt_ids, params, traffic_class))
            self._prompt_sent(tracked)
            return
        tracked.prefill = prefills[plan.prefill]
        chosen = prefill_candidates[plan.prefill]
        have = info.cached_tokens(chosen) + info.pullable_tokens(chosen)
        tracked.prefill_tokens = len(prompt_ids) - have
        self._workers[tracked.prefill].prefill_tokens += tracked.prefill_tokens
        d = self._workers[decode].endpoint
        prefill_id = self._workers[tracked.prefill].endpoint.worker_id
        spans = images.spans if images is not None else []
        peer = self._peer(info, prefills, tracked.prefill) if images is None else None
        tracked.pending_prefill = msg.Prefill(
            request_id, prompt_ids, params, d.worker_id, d.kv_addr, traffic_class, spans, peer
        )
        if images is not None:
            self._encode(tracked, request_id, images)
        self._send(decode, msg.Reserve(request_id, prompt_ids, params, prefill_id, spans))

    def _encode(self, tracked: Tracked, request_id: str, images: PromptImages) -> None:
        """Send the images to a vision worker, which sends the embeddings to the prefill
        worker while the decode worker reserves blocks."""
        now, timeout = time.monotonic(), self.heartbeat_timeout_s
        visions = [i for i in self._vision if self._workers[i].routable]
        candidates = [self._workers[i].candidate(now, timeout) for i in visions]
        hashes = [image.image_hash for image in images.data]
        tracked.vision = visions[self.vision_router.choose(candidates, hashes)]
        self._workers[tracked.vision].inflight += 1
        assert tracked.prefill is not None
        prefill = self._workers[tracked.prefill].endpoint
        message = msg.EncodeImages(request_id, images.data, prefill.worker_id, prefill.kv_addr)
        self._send(tracked.vision, message)

    def _cached(self, prompt_ids: list[int]) -> dict[str, int]:
        """Holder -> the prompt's leading blocks there: for cache-aware routing and, with
        more than one prefill worker, for pulling a prefix from a peer (_peer)."""
        if self.prefix is None:
            return {}
        if self.router.prefill_policy.name != "cache_aware" and len(self._prefill) < 2:
            return {}
        return self.prefix.cached_blocks(prompt_ids)

    def _pullable(
        self, cached: Mapping[str, int], prefills: list[int], now: float
    ) -> dict[str, int]:
        """Live prefill worker -> the prompt's leading blocks it could send to a peer."""
        if not cached or len(prefills) < 2:
            return {}
        live = [
            self._workers[i]
            for i in prefills
            if self._workers[i].healthy(now, self.heartbeat_timeout_s)
        ]
        return {w.endpoint.worker_id: _holds(cached, w) for w in live}

    def _peer(self, info: RequestInfo, prefills: list[int], chosen: int) -> msg.PeerPrefix | None:
        """A live prefill worker holding more of the prompt than the chosen one and its
        node's store: the chosen one pulls the difference from it
        (services/workers/peer_blocks.py)."""
        if not info.cached_blocks:
            return None
        cached = info.cached_blocks
        have = _holds(cached, self._workers[chosen])
        now = time.monotonic()
        peers = [
            self._workers[i]
            for i in prefills
            if i != chosen and self._workers[i].healthy(now, self.heartbeat_timeout_s)
        ]
        live = {w.endpoint.worker_id: w.endpoint for w in peers}
        # A peer serves from its device cache and its block store, whose disk tier is its
        # node's: a prefix on another node's disk is pulled through a worker of that node.
        holds = {w.endpoint.worker_id: _holds(cached, w) for w in peers}
        usable = max(len(info.prompt_ids) - 1, 0) // self.block_size
        found = best_peer(holds, have, live, usable)
        if found is None:
            return None
        return msg.PeerPrefix(found[0], live[found[0]].request_addr, found[1])

    def _count_decision(self, disaggregated: bool) -> None:
        m = self.metrics
        if disaggregated:
            m.router_decisions.labels(
                m.model_name, self.router.prefill_policy.name, "prefill"
            ).inc()
        m.router_decisions.labels(m.model_name, self.router.decode_policy.name, "decode").inc()

    def _prompt_done(self, tracked: Tracked) -> None:
        """The prompt worker no longer has this request's prompt to compute."""
        if tracked.prefill is not None:
            self._workers[tracked.prefill].prefill_tokens -= tracked.prefill_tokens
        tracked.prefill_tokens = 0
        if tracked.vision is not None:
            self._workers[tracked.vision].inflight -= 1
            tracked.vision = None

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop requests that have not finished; their workers free the KV blocks."""
        by_worker: dict[int, list[str]] = {}
        for request_id in request_ids:
            vision = self._tracked[request_id].vision if request_id in self._tracked else None
            tracked = self._untrack(request_id)
            if tracked is None:
                continue
            self.telemetry.failed(request_id, tracked, "abort")
            by_worker.setdefault(tracked.worker, []).append(request_id)
            if tracked.prefill is not None and tracked.pending_prefill is None:
                by_worker.setdefault(tracked.prefill, []).append(request_id)
            if vision is not None:
                by_worker.setdefault(vision, []).append(request_id)
        for worker, ids in by_worker.items():
            self._send(worker, msg.AbortRequest(ids))

    def _send(self, worker: int, message: msg.Message) -> None:
        self._workers[worker].socket.send(msg.encode(message))
        self._count_admitted()

    def _untrack(self, request_id: str) -> Tracked | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._prompt_done(tracked)
            self._workers[tracked.worker].inflight -= 1
            self._count_admitted()
        return tracked

    def _count_admitted(self) -> None:
        admitted = self.metrics.num_requests_admitted.labels(*self.metrics.labels(API_POOL, "api"))
        admitted.set(len(self._tracked))

    def _prompt_sent(self, tracked: Tracked) -> None:
        tracked.sent = time.monotonic()
        w = self._workers[tracked.prompt_worker]
        key = self.metrics.labels(w.pool, w.endpoint.worker_id)
        self.metrics.request_queue_time.labels(*key).observe(tracked.sent - tracked.start)

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
        elif isinstance(message, msg.IndexUpdate) and self.prefix is not None:
            u = message
            self.prefix.apply(u.holder, u.tier, u.stored, u.evicted, u.rebuild)
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
        self._prompt_sent(tracked)

    def _on_stats(self, stats: msg.WorkerStats) -> None:
        try:
            _, worker = self._find(stats.worker_id)
        except KeyError:
            return
        if worker.endpoint.role == "vision":
            self.metrics.observe_vision_stats(worker.pool, stats, worker.last_stats)
        else:
            self.metrics.observe_stats(worker.pool, stats, worker.last_stats)
        worker.last_stats = stats
        worker.last_seen = time.monotonic()
        worker.blocks_since_stats = 0
        self._count_workers()

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
                self._on_error(msg.RequestError(request_id, error, 503), "worker_lost")
        self._count_workers()

    def _on_delta(self, delta: msg.TokenDelta) -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:
            return
        if self.telemetry.tokens(tracked, len(delta.token_ids)):
            self._prompt_done(tracked)
        if delta.finish_reason is not None:
            self._untrack(delta.request_id)
            self.telemetry.finished(delta, tracked)
        tracked.group.queue.put_nowait((tracked.index, delta))

    def _on_error(self, error: msg.RequestError, reason: str = "") -> None:
        tracked = self._untrack(error.request_id)
        if tracked is not None:
            failure = reason or ("invalid_request" if error.status == 400 else "request_failed")
            self.telemetry.failed(error.request_id, tracked, failure)
            if tracked.prefill is not None:
                self.abort_elsewhere(tracked, error.request_id)
            tracked.group.queue.put_nowait((tracked.index, error))

    def abort_elsewhere(self, tracked: Tracked, request_id: str) -> None:
        """After an error from one hop, make sure the other hop frees what it holds."""
        targets = {tracked.worker}
        if tracked.prefill is not None and tracked.pending_prefill is None:
            targets.add(tracked.prefill)
        for worker in targets:
            self._send(worker, msg.AbortRequest([request_id]))


def _holds(cached: Mapping[str, int], worker: WorkerState) -> int:
    """Leading blocks a worker can serve: its own (device, host) or its node's disk tier's."""
    node = worker.last_stats.node_id if worker.last_stats is not None else ""
    return max(cached.get(worker.endpoint.worker_id, 0), cached.get(node, 0) if node else 0)


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
