"""The API server's worker pool: membership, sockets, heartbeats and each worker's load.

One PUSH socket per worker carries requests and aborts; one PULL socket, connected to every
worker, brings their output back (the request exchange reads it, exchange.py). Both are
CurveZMQ clients with the deployment's keys (splitserve/curve.py): the workers admit nobody
else. WorkerStats
(from the worker's loop) and Heartbeats (from a thread of its own, so that a step longer than
the timeout does not look like a dead worker) are the heartbeats: a worker silent for
``heartbeat_timeout_s`` is unhealthy, and one that sent
WorkerFailed is failed for good (unhealthy and never routed to again). Workers join with
``add_worker`` and leave through ``drain``: no new requests, then removal once nothing in
flight waits on them. Nothing here routes or tracks requests.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

import zmq
import zmq.asyncio

from splitserve import curve
from splitserve.services import messages as msg
from splitserve.services.api.worker_view import WorkerEndpoint, WorkerState
from splitserve.services.metrics import API_POOL, Metrics
from splitserve.services.sealing import Forged, Rejections, Sealer

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 15.0
DRAIN_POLL_S = 0.05


class WorkerPool:
    def __init__(
        self,
        endpoints: Sequence[WorkerEndpoint],
        metrics: Metrics,
        sealer: Sealer,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.metrics = metrics
        self.sealer = sealer
        self.rejected = Rejections(log, "API server")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._keys = sealer.curve_keys()
        self._pull = curve.client(self._async_ctx.socket(zmq.PULL), self._keys)
        self._workers: list[WorkerState] = []
        """Every worker ever added, oldest first; removed ones stay, marked removed."""
        for endpoint in endpoints:
            self._connect(endpoint)

    def _connect(self, endpoint: WorkerEndpoint) -> None:
        socket = curve.client(self._sync_ctx.socket(zmq.PUSH), self._keys)
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(endpoint.request_addr)
        self._workers.append(WorkerState(endpoint, socket))
        self._pull.connect(endpoint.output_addr)

    def close(self) -> None:
        self._pull.close(linger=0)
        self._sync_ctx.destroy(linger=0)
        self._async_ctx.term()

    def send(self, worker: WorkerState, message: msg.Message) -> None:
        """Send to a worker; nothing goes to a removed one (its socket is closed, and it no
        longer holds any of our requests)."""
        if not worker.removed:
            worker.socket.send(self.sealer.seal(message))

    async def receive(self, timeout_s: float) -> bytes | None:
        """The body of the next message any worker sent, its seal checked (one not sealed
        by this deployment is dropped and counted); None after ``timeout_s`` without one."""
        if not await self._pull.poll(timeout_s * 1000):
            return None
        data: bytes = await self._pull.recv()
        try:
            return self.sealer.check(data)
        except Forged as forged:
            self.rejected.add(forged)
            self.metrics.rejected_messages.labels(*self.metrics.labels(API_POOL, API_POOL)).inc()
            return None

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

    def restarting(self) -> bool:
        """Some worker stopped and is still in the pool: its supervisor is restarting it
        (the restarted one replaces it under its id)."""
        return any(w.failed is not None for w in self._live())

    def count(self, role: str) -> int:
        """Workers of a role that are not removed (draining and failed ones included)."""
        return sum(w.endpoint.role == role for w in self._live())

    def routable(self, *roles: str) -> list[WorkerState]:
        """The workers of these roles that take new requests, oldest first."""
        return [w for w in self._workers if w.routable and w.endpoint.role in roles]

    def worker_ids(self, pool: str) -> list[str]:
        """The ids of a pool's workers that take new requests, oldest first."""
        return [w.worker_id for w in self._workers if w.routable and w.pool == pool]

    def find(self, worker_id: str) -> WorkerState:
        """The worker with this id that is not removed; KeyError if there is none."""
        for w in self._workers:
            if w.worker_id == worker_id and not w.removed:
                return w
        raise KeyError(worker_id)

    def add_worker(self, endpoint: WorkerEndpoint) -> None:
        """Route to a newly started worker from now on."""
        self._connect(endpoint)
        self.count_workers()

    def replace(self, endpoint: WorkerEndpoint) -> None:
        """A worker that stopped runs again under its id (restarted, with new addresses): the
        old one leaves and the new one is routed to from now on (once it reports in)."""
        try:
            old = self.find(endpoint.worker_id)
        except KeyError:
            return  # removed meanwhile (scaled away): the new one is not part of the pool
        self._disconnect(old)
        self._connect(endpoint)
        self.metrics.worker_restarts.labels(*self.metrics.labels(old.pool, old.worker_id)).inc()
        self.count_workers()

    def _disconnect(self, worker: WorkerState) -> None:
        worker.removed = True
        worker.draining = False
        worker.socket.close(linger=0)
        self._pull.disconnect(worker.endpoint.output_addr)

    async def drain(self, worker_id: str) -> None:
        """Stop routing new requests to a worker and wait until no request in flight waits
        on it (a prefill worker's once their first token arrived, a decode worker's once they
        finished), then stop talking to it."""
        worker = self.find(worker_id)
        worker.draining = True
        self.count_workers()
        while worker.busy:
            await asyncio.sleep(DRAIN_POLL_S)
        self._disconnect(worker)
        self.metrics.forget_worker(worker.pool, worker_id)
        self.count_workers()

    def on_stats(self, stats: msg.WorkerStats) -> None:
        """A worker's heartbeat and load report."""
        try:
            worker = self.find(stats.worker_id)
        except KeyError:
            return
        if worker.endpoint.role == "vision":
            self.metrics.observe_vision_stats(worker.pool, stats, worker.last_stats)
        else:
            self.metrics.observe_stats(worker.pool, stats, worker.last_stats)
        worker.last_stats = stats
        worker.last_seen = time.monotonic()
        worker.blocks_since_stats = 0
        self.count_workers()

    def on_heartbeat(self, beat: msg.Heartbeat) -> None:
        """A worker is alive, its loop maybe inside a long step (stats come from the loop)."""
        try:
            worker = self.find(beat.worker_id)
        except KeyError:
            return
        worker.last_seen = time.monotonic()
        if beat.loop_busy_s >= self.heartbeat_timeout_s > worker.loop_busy_s:
            log.warning(
                "worker %s: its loop has been in one round for %.0f s (alive: heartbeats)",
                beat.worker_id,
                beat.loop_busy_s,
            )
        worker.loop_busy_s = beat.loop_busy_s

    def mark_failed(self, worker_id: str, reason: str) -> WorkerState | None:
        """A worker reported that its loop stopped: it is unhealthy and unroutable from now
        on. Returns it, or None for a worker this pool does not have."""
        try:
            worker = self.find(worker_id)
        except KeyError:
            return None
        worker.failed = reason
        self.count_workers()
        return worker

    def fail_group(self, worker: WorkerState) -> list[WorkerState]:
        """Marks the other ranks of failed ``worker``'s expert-parallel group failed too (a
        group stops whole), so that none of its requests migrates onto one; returns them."""
        ranks = [w for w in self.group_of(worker) if w.failed is None]
        for rank in ranks:
            rank.failed = f"{worker.worker_id} of its group stopped"
        self.count_workers()
        return ranks

    def group_of(self, worker: WorkerState) -> list[WorkerState]:
        """The workers of ``worker``'s replica: the ranks of its expert-parallel group."""
        return [w for w in self._live() if w.group == worker.group]

    def lost(self, now: float) -> list[WorkerState]:
        """Workers that reported in once and are unhealthy now (silent or failed)."""
        timeout = self.heartbeat_timeout_s
        return [
            w for w in self._workers if w.last_stats is not None and not w.healthy(now, timeout)
        ]

    def count_workers(self) -> None:
        """Publish how many workers of each pool are in each state."""
        now = time.monotonic()
        counts: dict[str, dict[str, int]] = {}
        groups: dict[tuple[str, str], dict[str, int]] = {}
        for w in self._live():
            states = counts.setdefault(w.pool, {})
            state = w.state(now, self.heartbeat_timeout_s)
            states[state] = states.get(state, 0) + 1
            if w.group != w.worker_id:  # a rank of an expert-parallel group
                ranks = groups.setdefault((w.pool, w.group), {})
                ranks[state] = ranks.get(state, 0) + 1
        self.metrics.set_num_workers(counts)
        self.metrics.set_group_ranks(groups)
