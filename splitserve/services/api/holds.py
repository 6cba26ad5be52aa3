"""Requests held for a worker to come back: a request whose worker stopped, with no healthy
worker left in a pool it needs (the only decode or prefill worker of a 1P1D deployment), waits
for the supervisor to restart one (services/launch/supervisor.py: a few seconds) instead of
failing at once. The exchange retries each held request at its sweeps (exchange.py) until it
migrates (migration.py), ``server.restart_wait_s`` has passed since it was first held, or its
deadline (``server.request_timeout_s``) ends it; then it fails with the 503 it was held on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from splitserve.services import messages as msg
from splitserve.services.api.worker_view import WorkerState


@dataclass(frozen=True)
class Held:
    since: float
    error: msg.RequestError
    """The 503 it fails with if no worker comes back in time."""
    stopped: WorkerState | None
    reason: str


class Holds:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self._held: dict[str, Held] = {}

    def keep(self, error: msg.RequestError, stopped: WorkerState | None, reason: str) -> bool:
        """Hold (or go on holding) ``error.request_id``; False once it waited ``wait_s``.
        A request held already keeps its first error (the cause, not a later symptom)."""
        now = time.monotonic()
        held = self._held.setdefault(error.request_id, Held(now, error, stopped, reason))
        return now - held.since < self.wait_s

    def release(self, request_id: str) -> msg.RequestError | None:
        """It migrated or fails now: no longer held. Returns the error it was first held on."""
        held = self._held.pop(request_id, None)
        return held.error if held is not None else None

    def all(self) -> list[Held]:
        return list(self._held.values())
