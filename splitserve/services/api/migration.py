"""Request migration: a request whose worker stopped continues on another one.

When a worker stops (its process died, it sent WorkerFailed, or its heartbeat stopped), each
request that waits on it (exchange.py: ``Tracked.waits_on``) is sent again, as a new attempt
with an id of its own, to workers the router picks among those left. The new attempt's prompt
is the original prompt followed by the tokens the client already got, and ``resumed`` says how
many those are: the engine continues sampling after them (engine/resume.py), and the API
server streams only what comes after, so the client sees one stream. The prompt's KV comes
from wherever the router finds it: a prefill worker's prefix cache or the block store (the
original prompt's blocks are usually still there), else it is computed again.

A request moves at most ``server.migration_limit`` times; past it, it fails with a 503 as
before. Each move is counted in ``request_migrations_total``, labelled by the worker it left.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
from collections.abc import Callable

from splitserve.router.router import NoWorkerError, Route
from splitserve.services import messages as msg
from splitserve.services.api.inflight import InFlight
from splitserve.services.api.routing import Routing
from splitserve.services.api.submission import Submission
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import Tracked, WorkerState
from splitserve.services.metrics import Metrics

log = logging.getLogger("splitserve.api")


class Outcome(enum.Enum):
    MOVED = "moved"
    WAIT = "wait"
    """A pool it needs has no healthy worker now (one may be back soon: holds.py)."""
    FAILED = "failed"
    """Past the limit, or nothing to send again."""


Send = Callable[[str, Tracked, Submission, Route, dict[str, WorkerState]], None]
"""The exchange's way to track an attempt and send its first hop (RequestExchange._send)."""


class Migrations:
    """Moves requests off stopped workers; knows which attempt of each is the current one."""

    def __init__(
        self,
        limit: int,
        metrics: Metrics,
        pool: WorkerPool,
        inflight: InFlight,
        routing: Routing,
        send: Send,
    ) -> None:
        self.limit = limit
        self.metrics = metrics
        self.pool = pool
        self.inflight = inflight
        self.routing = routing
        self._send = send
        self._current: dict[str, str] = {}
        """Original request id -> its current attempt's id (migrated requests only)."""

    def current(self, request_id: str) -> str:
        """The id under which the request runs now."""
        return self._current.get(request_id, request_id)

    def forget(self, request_id: str) -> None:
        """The request (by its original id) is over."""
        self._current.pop(request_id, None)

    def migrate(self, request_id: str, stopped: WorkerState | None, why: str) -> Outcome:
        """Send the attempt ``request_id`` again, after the tokens its client got, to the
        workers left (MOVED); nothing is done past the limit (FAILED) or with no healthy
        worker in a pool it needs (WAIT).
        stopped: the worker it leaves (None: a worker failed it; its decode worker is named)."""
        tracked = self.inflight.get(request_id)
        if tracked is None or tracked.submission is None or tracked.migrations >= self.limit:
            return Outcome.FAILED
        resumed = tracked.submission.resumed_after(tracked.token_ids, tracked.text_chars)
        new_id = f"{tracked.request_id}.m{tracked.migrations + 1}"
        try:
            # By load alone: a migration runs on the event loop (the reader, the sweep),
            # where the prefix index is not asked (a remote one could stall it).
            route, workers = self.routing.route(new_id, resumed.prompt_ids, resumed.images, {})
        except NoWorkerError as exc:
            log.info("request %s cannot migrate now: %s", request_id, exc)
            return Outcome.WAIT
        chosen = [workers[w] for w in (route.decode, route.prefill, route.vision) if w]
        if any(w is stopped or not self._healthy(w) for w in chosen):
            return Outcome.WAIT  # the router found no healthy worker in a pool: not now
        for worker in tracked.hops():
            if worker is not stopped:
                self.pool.send(worker, msg.AbortRequest([request_id]))
        left = stopped or tracked.worker
        self.inflight.moved(request_id)
        tracked.new_attempt(workers[route.decode])
        self._current[tracked.request_id] = new_id
        key = self.metrics.labels(left.pool, left.worker_id)
        self.metrics.request_migrations.labels(*key, why).inc()
        log.info("request %s continues as %s (%s)", request_id, new_id, why)
        self._send(new_id, tracked, resumed, route, workers)
        return Outcome.MOVED

    def _healthy(self, worker: WorkerState) -> bool:
        return worker.healthy(time.monotonic(), self.pool.heartbeat_timeout_s)


def as_original(tracked: Tracked, delta: msg.TokenDelta) -> msg.TokenDelta:
    """A migrated attempt's delta as the client's request sees it: its usage counts the
    original prompt, not the one the attempt was sent with."""
    if not tracked.migrations or tracked.submission is None:
        return delta
    prompt_tokens = len(tracked.submission.prompt_ids)
    cached = min(delta.num_cached_tokens, prompt_tokens)
    return dataclasses.replace(delta, num_prompt_tokens=prompt_tokens, num_cached_tokens=cached)
