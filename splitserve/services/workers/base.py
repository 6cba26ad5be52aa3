"""Worker: the process around one engine (or one vision encoder), driven by messages.

Every role is a subclass: ``EngineWorker`` (services/workers/engine_worker.py, role ``both``)
and its ``PrefillWorker`` / ``DecodeWorker``, and ``VisionWorker``. The launcher turns the
class into a Ray actor built from one ``WorkerSpec``; the class itself is plain, so tests run
it without Ray. ``start`` binds a PULL socket for requests and a PUSH socket for outputs and
starts the loop thread: drain the input sockets, do one round of work, report stats a few
times a second. Only the loop thread touches the engine, which is not thread-safe.

A loop that meets an unexpected error goes on: the error is logged and only the requests it
concerns fail with a 500 (a message's request; for a round, ``_failed_round``: an engine
worker's requests in its engine). A sender or receiver thread that stops on an error, or
MAX_FAILED_ROUNDS rounds that raise within a minute, stop the loop instead: every request
the worker holds fails with a 503 and ``WorkerFailed`` tells the API server, whose
supervisor has Ray restart the process (services/launch/supervisor.py).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
import zmq

from splitserve import curve
from splitserve.engine.phases import PhaseTimer
from splitserve.kvstore.transfer import KVTransport
from splitserve.services import messages as msg
from splitserve.services.sealing import Forged, Rejections
from splitserve.services.workers import limits
from splitserve.services.workers.channels import peer_name
from splitserve.services.workers.spec import WorkerSpec

STATS_INTERVAL_S = 0.2
HEARTBEAT_INTERVAL_S = 1.0
"""Heartbeats come from a thread of their own (the loop's stats stop during a long step)."""
IDLE_POLL_MS = 50
MAX_FAILED_ROUNDS = 3
"""Rounds that raise within FAILED_ROUNDS_WINDOW_S before the worker gives up (WorkerFailed;
its supervisor restarts the process): a fault that keeps coming back is not transient."""
FAILED_ROUNDS_WINDOW_S = 60.0
logger = logging.getLogger("splitserve.worker")


@dataclass(frozen=True)
class WorkerInfo:
    """What the API server needs to know about a started worker (plain values only).

    kv_addr: where a decode worker receives KV headers, a prefill worker image embeddings and
    peer blocks ("" for other roles).
    """

    worker_id: str
    role: str
    model_name: str
    max_model_len: int
    request_addr: str
    output_addr: str
    kv_addr: str
    pid: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class ThreadFailed(RuntimeError):
    """One of the worker's sender or receiver threads stopped on an unexpected error."""


class Worker(ABC):
    """Sockets, the loop thread, errors and stats; subclasses do the work.

    Subclasses implement ``_load`` (set ``model_name`` and ``max_model_len``), ``_handle``
    (one message), ``_tick`` (one round of work), ``_stats`` and ``_held`` (the requests to
    fail if the loop stops); ``_setup`` adds sockets and threads before the loop starts.
    """

    role = ""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.worker_id = spec.worker_id
        self.kv_addr = ""
        self.model_name = spec.engine.model
        self.max_model_len = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._errors: list[msg.RequestError] = []
        self._async_errors: queue.Queue[msg.RequestError] = queue.Queue()
        self._thread_failures: queue.Queue[str] = queue.Queue()
        self._last_stats = 0.0
        self._send_lock = threading.Lock()
        """The output socket is the loop's and the heartbeat thread's: one sender at a time."""
        self._round_started = time.monotonic()
        self._heartbeat: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._info: dict[str, Any] | None = None
        self.generation = 0
        self.phases = PhaseTimer()
        """The loop's time by phase (idle, receive, stats; subclasses add theirs)."""
        self.sealer = spec.sealer
        self.rejected = Rejections(logger, f"worker {spec.worker_id}")
        """Messages dropped unread: their HMAC is missing or wrong (services/sealing.py)."""

    def start(self, generation: int = 0) -> dict[str, Any]:
        """Load the model, bind the sockets, start the loop; returns WorkerInfo as a dict
        (a second call returns the first one's: a supervisor may call again, not knowing
        whether its call ran). generation: which start of its expert-parallel group this is
        (services/workers/expert_group.py; the launcher counts them)."""
        with self._start_lock:
            if self._info is None:
                self.generation = generation
                self._info = self._start_once()
            return self._info

    def _start_once(self) -> dict[str, Any]:
        if self.spec.threads > 0:
            torch.set_num_threads(self.spec.threads)
        self._load()
        self._ctx = zmq.Context()
        self.gate = curve.Gate(self._ctx, self.sealer.curve_keys())
        """Admits to the worker's sockets only the deployment's processes (splitserve/curve.py)."""
        self._requests, self.request_addr = self._bind(zmq.PULL, self._request_bytes())
        self._outputs, output_addr = self._bind(zmq.PUSH, limits.OUTPUT_SOCKET_BYTES)
        self._outputs.setsockopt(zmq.SNDHWM, 0)
        self._outputs.setsockopt(zmq.LINGER, 0)
        self._poller = zmq.Poller()
        self._poller.register(self._requests, zmq.POLLIN)
        self._setup()
        self._thread = threading.Thread(target=self._loop, name=f"{self.role}-loop", daemon=True)
        self._thread.start()
        self._heartbeat = threading.Thread(
            target=self._beat, name=f"{self.role}-heartbeat", daemon=True
        )
        self._heartbeat.start()
        return WorkerInfo(
            worker_id=self.worker_id,
            role=self.role,
            model_name=self.model_name,
            max_model_len=self.max_model_len,
            request_addr=self.request_addr,
            output_addr=output_addr,
            kv_addr=self.kv_addr,
            pid=os.getpid(),
        ).to_dict()

    def stop(self) -> None:
        """Stop the loop and close the sockets (requests in flight are dropped)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join(timeout=10)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self.gate.stop()
            self._ctx.destroy(linger=0)

    def wait_stopped(self) -> None:
        """Returns once ``stop`` was called: a supervisor keeps this call pending to learn
        when the process dies (Ray fails the call then; services/launch/supervisor.py)."""
        self._stop.wait()

    def _bind(self, kind: int, max_bytes: int) -> tuple[zmq.Socket, str]:
        """A socket on a free port of the worker's host, taking only the deployment's
        processes (CurveZMQ) and messages of at most ``max_bytes``; and its address."""
        socket = curve.server(self._ctx.socket(kind), self.sealer.curve_keys())
        socket.setsockopt(zmq.MAXMSGSIZE, max_bytes)
        host = self.spec.bind_host
        return socket, f"tcp://{host}:{socket.bind_to_random_port(f'tcp://{host}')}"

    def _request_bytes(self) -> int:
        """The largest message the request socket takes (services/workers/limits.py)."""
        return limits.request_bytes(self.spec.max_body_bytes, self.max_model_len)

    @abstractmethod
    def _load(self) -> None:
        """Load the engine or encoder (before the sockets exist)."""

    def _setup(self) -> None:  # noqa: B027 (optional: EngineWorker has nothing to add)
        """Role-specific sockets and threads, created before the loop starts."""

    @abstractmethod
    def _handle(self, message: msg.Message) -> None: ...

    @abstractmethod
    def _tick(self) -> None:
        """One round of work, and the outputs and errors it produced."""

    @abstractmethod
    def _stats(self) -> msg.WorkerStats: ...

    @abstractmethod
    def _held(self) -> list[str]:
        """Every request this worker holds: queued, reserved, running."""

    def _poll_ms(self) -> int:
        return IDLE_POLL_MS

    def _failed_round(self) -> list[str]:
        """The requests a round that raised has failed: by default every one held."""
        return self._held()

    def _loop(self) -> None:
        self.phases.start()
        failures: collections.deque[float] = collections.deque(maxlen=MAX_FAILED_ROUNDS)
        while not self._stop.is_set():
            try:
                self._round()
            except ThreadFailed as exc:
                self._crashed(exc)
                return
            except Exception as exc:
                failures.append(time.monotonic())
                if self._steps_in_lockstep() or (
                    len(failures) == MAX_FAILED_ROUNDS
                    and failures[-1] - failures[0] < FAILED_ROUNDS_WINDOW_S
                ):
                    self._crashed(exc)
                    return
                self._recover(exc, self._failed_round())
        self._leave()

    def _steps_in_lockstep(self) -> bool:
        """A rank of an expert-parallel group: a round that raised may have skipped the
        group's collectives, so the rank cannot go on in step with the others and stops."""
        return False

    def _leave(self) -> None:  # noqa: B027 (optional: only a rank of a group has to)
        """After the loop stopped on purpose (``stop``): tell whoever steps with this loop."""

    def _recover(self, exc: Exception, request_ids: list[str]) -> None:
        """A round or a message raised: log it, fail (and drop) only the requests it concerns
        with a 500 (the request itself may be the cause: it is not tried elsewhere), go on."""
        logger.exception("worker %s: failed %s; the loop goes on", self.worker_id, request_ids)
        error = f"worker {self.worker_id} failed this request: {type(exc).__name__}: {exc}"
        try:
            self._handle(msg.AbortRequest(request_ids))
        except Exception:
            logger.exception("worker %s: dropping %s failed too", self.worker_id, request_ids)
        self._errors += [msg.RequestError(request_id, error, 500) for request_id in request_ids]
        self._send_batch([])

    def _beat(self) -> None:
        """Heartbeats while the loop runs (one that stopped has said so: WorkerFailed)."""
        loop = self._thread
        while not self._stop.wait(HEARTBEAT_INTERVAL_S) and loop is not None and loop.is_alive():
            busy = time.monotonic() - self._round_started
            self._send(msg.Heartbeat(self.worker_id, busy))

    def _round(self) -> None:
        self._round_started = time.monotonic()
        if not self._thread_failures.empty():
            raise ThreadFailed(self._thread_failures.get_nowait())
        self._drain(self._poll_ms())
        self._tick()
        self._maybe_send_stats()
        self.phases.lap("stats")

    def _thread_failed(self, reason: str) -> None:
        """Called by a sender or receiver thread that stopped (see channels.py)."""
        self._thread_failures.put(reason)

    def _crashed(self, exc: Exception) -> None:
        """Fail everything held at once (not after the API server's heartbeat timeout)."""
        logger.exception("worker %s: its loop stopped", self.worker_id)
        reason = f"{type(exc).__name__}: {exc}"
        error = f"worker {self.worker_id} failed: {reason}"
        held = self._held()
        failed = [msg.RequestError(request_id, error, 503) for request_id in held]
        self._collect_async_errors()
        earlier = [e for e in self._errors if e.request_id not in held]
        self._errors = []
        # WorkerFailed first: the API server takes this worker (and its expert-parallel group)
        # out of the pool and moves its requests before it reads their 503s, which then concern
        # attempts that have moved on; the other way round, a request could move onto a rank
        # of this broken group and have to move again.
        self._send(msg.WorkerFailed(self.worker_id, reason))
        self._send(msg.OutputBatch(deltas=[], errors=earlier + failed))

    def _drain(self, timeout_ms: int) -> None:
        ready = self._poller.poll(timeout_ms)
        self.phases.lap("idle" if timeout_ms else "receive")
        for socket, _ in ready:
            while True:
                try:
                    data = socket.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    message = self.sealer.unseal(data)
                except Forged as forged:
                    self.rejected.add(forged)
                    continue
                except ValueError:
                    continue  # sealed by us but not a message: dropped
                if not self._defer(message):
                    self._handle_guarded(message)
        self.phases.lap("receive")

    def _handle_guarded(self, message: msg.Message) -> None:
        """One message; if handling it raises, only its request fails."""
        try:
            self._handle(message)
        except Exception as exc:
            request_id = getattr(message, "request_id", None)
            self._recover(exc, [request_id] if isinstance(request_id, str) else [])

    def _defer(self, message: msg.Message) -> bool:
        """True to keep the message from ``_handle`` for now (a subclass hands it on later)."""
        return False

    def _collect_async_errors(self) -> None:
        while not self._async_errors.empty():
            self._errors.append(self._async_errors.get_nowait())

    def _send_batch(self, deltas: list[msg.TokenDelta]) -> None:
        """The deltas, and every error since the last batch, to the API server."""
        self._collect_async_errors()
        if deltas or self._errors:
            batch = msg.OutputBatch(deltas=deltas, errors=self._errors)
            self._errors = []
            self._send(batch)

    def _send(self, message: msg.Message) -> None:
        """To the API server. The queue is unbounded, so this only fails when no API server
        is connected (not yet, or it stopped or dropped this worker): then the message has
        nobody to go to, and blocking here would hang the loop and its shutdown."""
        data = self.sealer.seal(message)
        with self._send_lock, contextlib.suppress(zmq.Again):
            self._outputs.send(data, zmq.NOBLOCK)

    def _maybe_send_stats(self) -> None:
        now = time.monotonic()
        if now - self._last_stats < STATS_INTERVAL_S:
            return
        self._last_stats = now
        self._send(self._stats())


def open_transport(spec: WorkerSpec, addr: str) -> KVTransport:
    """A worker's KV transport, from its spec's rendezvous store and transfer config, named
    after the worker and ``addr`` (channels.peer_name)."""
    assert spec.store is not None, f"worker {spec.worker_id} needs the rendezvous store"
    transfer, name = spec.transfer, peer_name(spec.worker_id, addr)
    device = torch.device(spec.engine.device)
    return KVTransport(
        name,
        spec.store,
        device,
        transfer.backend,
        transfer.timeout_s,
        key=spec.sealer.store_key(),
    )
