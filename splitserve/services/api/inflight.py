"""The engine requests in flight at the API server, and the load they put on each worker.

One Tracked per engine request, from admission to its end (finished, failed or aborted).
While tracked, a request counts in its workers' load state (worker_view.WorkerState): in its
decode worker's ``inflight`` until it ends, in its prefill worker's ``prompts`` and
``prefill_tokens`` and its vision worker's ``inflight`` until its first token. The request
exchange (exchange.py) decides what happens to requests; this keeps their bookkeeping and
their metrics (telemetry.py) in one place.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from splitserve.services import messages as msg
from splitserve.services.api.telemetry import RequestTelemetry
from splitserve.services.api.worker_view import Tracked, WorkerState
from splitserve.services.metrics import API_POOL, Metrics


class InFlight:
    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.telemetry = RequestTelemetry(metrics)
        self._tracked: dict[str, Tracked] = {}

    def __len__(self) -> int:
        return len(self._tracked)

    def get(self, request_id: str) -> Tracked | None:
        return self._tracked.get(request_id)

    def add(self, request_id: str, tracked: Tracked, blocks: int) -> None:
        """Track a request sent to ``tracked.worker``, whose prompt takes ``blocks`` KV blocks
        there (counted against the worker's free blocks until its next report)."""
        self._tracked[request_id] = tracked
        tracked.worker.inflight += 1
        tracked.worker.blocks_since_stats += blocks
        self._count()

    def add_prefill(self, tracked: Tracked, prefill: WorkerState, tokens: int) -> None:
        """The request's prompt goes to ``prefill``, which is expected to compute ``tokens``."""
        tracked.prefill = prefill
        tracked.prefill_tokens = tokens
        prefill.prefill_tokens += tokens
        prefill.prompts += 1

    def add_vision(self, tracked: Tracked, vision: WorkerState) -> None:
        """The request's images go to ``vision``."""
        tracked.vision = vision
        vision.inflight += 1

    def prompt_sent(self, tracked: Tracked) -> None:
        """The prompt left for the worker that computes it: the end of its queue time."""
        tracked.sent = time.monotonic()
        w = tracked.prompt_worker
        key = self.metrics.labels(w.pool, w.worker_id)
        self.metrics.request_queue_time.labels(*key).observe(tracked.sent - tracked.start)

    def on_delta(self, delta: msg.TokenDelta) -> Tracked | None:
        """Count a delta's tokens; a finished request stops being tracked. Returns the
        request's Tracked, None for a request not tracked (aborted, failed)."""
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:
            return None
        self.telemetry.tokens(tracked, len(delta.token_ids))
        if delta.token_ids:
            self._prompt_done(tracked)
        if delta.finish_reason is not None:
            self._untrack(delta.request_id)
            self.telemetry.finished(delta, tracked)
        return tracked

    def remove(self, request_id: str, reason: str) -> Tracked | None:
        """Stop tracking a request that did not finish; ``reason`` labels its failure."""
        tracked = self._untrack(request_id)
        if tracked is not None:
            self.telemetry.failed(request_id, tracked, reason)
        return tracked

    def moved(self, request_id: str) -> Tracked | None:
        """Stop tracking an attempt that migrates (neither finished nor failed): its workers no
        longer count it; ``add`` tracks its next attempt."""
        return self._untrack(request_id)

    def overdue(self, now: float) -> list[tuple[str, Tracked]]:
        """(request id, Tracked) for each request past its deadline."""
        return [(r, t) for r, t in self._tracked.items() if t.deadline < now]

    def waiting_on(self, workers: Sequence[WorkerState]) -> list[tuple[str, WorkerState]]:
        """(request id, the first of ``workers`` it waits on) for each request waiting on one."""
        waiting = []
        for request_id, tracked in self._tracked.items():
            stopped = next((w for w in workers if tracked.waits_on(w)), None)
            if stopped is not None:
                waiting.append((request_id, stopped))
        return waiting

    def _untrack(self, request_id: str) -> Tracked | None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is not None:
            self._prompt_done(tracked)
            tracked.worker.inflight -= 1
            self._count()
        return tracked

    def _prompt_done(self, tracked: Tracked) -> None:
        """The prompt's workers (prefill, vision) no longer have anything to do for it."""
        if tracked.prompt_done:
            return
        tracked.prompt_done = True
        if tracked.prefill is not None:
            tracked.prefill.prefill_tokens -= tracked.prefill_tokens
            tracked.prefill.prompts -= 1
        tracked.prefill_tokens = 0
        if tracked.vision is not None:
            tracked.vision.inflight -= 1
            tracked.vision = None

    def _count(self) -> None:
        admitted = self.metrics.num_requests_admitted.labels(*self.metrics.labels(API_POOL, "api"))
        admitted.set(len(self._tracked))
