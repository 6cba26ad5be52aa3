"""The API server's end of a started worker's sockets, for tests that run workers in-process
(their loops, ZMQ sockets and gloo transports, without Ray)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import zmq

from splitserve import curve
from splitserve.engine.config import EngineConfig
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.engine_worker import EngineWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.wait import wait_for


class ApiEnd:
    """A PUSH socket to the worker's requests and a PULL socket on its outputs, connected once
    the worker's first stats arrive. Every message read is kept in ``seen``; WorkerStats and
    IndexUpdate are read and kept like the others. Messages are sealed and checked with
    ``sealer``, the worker's (its spec's)."""

    def __init__(self, info: dict[str, Any], sealer: Sealer) -> None:
        self.sealer = sealer
        self.ctx = zmq.Context()
        keys = sealer.curve_keys()
        self.push = curve.client(self.ctx.socket(zmq.PUSH), keys)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.connect(info["request_addr"])
        self.pull = curve.client(self.ctx.socket(zmq.PULL), keys)
        self.pull.connect(info["output_addr"])
        self.seen: list[msg.Message] = []
        self.errors: dict[str, msg.RequestError] = {}
        self.tokens: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        # The worker drops what it sends before this end is connected (a Reserved, say):
        # its stats, sent a few times a second, show that the connection is up.
        self.wait("the worker's first stats", self.latest_stats, 10)

    def send(self, message: msg.Message) -> None:
        self.push.send(self.sealer.seal(message))

    def wait(self, what: str, done: Callable[[], object], timeout_s: float) -> float:
        """Read outputs until ``done()``; the seconds it took. AssertionError after timeout_s."""

        def read_then_check() -> bool:
            while self.pull.poll(0):
                self._read(self.sealer.unseal(self.pull.recv()))
            return bool(done())

        return wait_for(
            read_then_check,
            timeout_s,
            interval=0.01,
            message=lambda: f"{what} (seen: {self.kinds()})",
        )

    def reserved(self, request_id: str) -> bool:
        return any(isinstance(m, msg.Reserved) and m.request_id == request_id for m in self.seen)

    def latest_stats(self) -> msg.WorkerStats | None:
        stats = [m for m in self.seen if isinstance(m, msg.WorkerStats)]
        return stats[-1] if stats else None

    def idle_stats(self) -> msg.WorkerStats | None:
        """The latest stats sent after the last output batch and showing nothing running or
        waiting (None until one arrives): the worker's loop sends a round's outputs before its
        stats, so only these show the blocks of the requests that just finished freed."""
        for message in reversed(self.seen):
            if isinstance(message, msg.OutputBatch):
                return None
            if isinstance(message, msg.WorkerStats):
                idle = message.num_running == 0 and message.num_waiting == 0
                return message if idle else None
        return None

    def failed_workers(self) -> list[msg.WorkerFailed]:
        return [m for m in self.seen if isinstance(m, msg.WorkerFailed)]

    def kinds(self) -> list[str]:
        return sorted({type(m).__name__ for m in self.seen})

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def _read(self, message: msg.Message) -> None:
        self.seen.append(message)
        if isinstance(message, msg.OutputBatch):
            for error in message.errors:
                self.errors[error.request_id] = error
            for delta in message.deltas:
                self.tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
                if delta.finish_reason is not None:
                    self.finished.add(delta.request_id)


@contextmanager
def colocated_worker(model: str, **engine: Any) -> Iterator[tuple[EngineWorker, ApiEnd]]:
    """A started worker of role ``both`` on the model (no threads of its own) and the API
    server's end of its sockets; both closed at the end."""
    worker = EngineWorker(WorkerSpec("both-0", "both", EngineConfig(model, **engine), threads=0))
    api = ApiEnd(worker.start(), worker.sealer)
    try:
        yield worker, api
    finally:
        api.close()
        worker.stop()
