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
from dataclasses import dataclass

from splitserve.engine.sampling_params import SamplingParams
from splitserve.services.api.images import PromptImages
from splitserve.services.metrics import Metrics


@dataclass(frozen=True)
class Submission:
    """What the exchange sends for one engine request, kept to send it again."""

    prompt_ids: list[int]
    params: SamplingParams
    traffic_class: str | None = None
    images: PromptImages | None = None
    resumed: int = 0
    """The prompt's last tokens that are output of an earlier attempt."""

    def resumed_after(self, tokens: list[int]) -> Submission:
        """This (original) request continued after ``tokens``, the output already streamed:
        they are appended to the prompt and counted against max_tokens and min_tokens."""
        if not tokens:
            return self
        done, params = len(tokens), self.params
        max_tokens = None if params.max_tokens is None else params.max_tokens - done
        min_tokens = max(0, params.min_tokens - done)
        params = dataclasses.replace(params, max_tokens=max_tokens, min_tokens=min_tokens)
        prompt = self.prompt_ids + tokens
        return Submission(prompt, params, self.traffic_class, self.images, done)


class Migrations:
    """Which attempt of each migrated request is the current one, and the migration limit."""

    def __init__(self, limit: int, metrics: Metrics) -> None:
        self.limit = limit
        self.metrics = metrics
        self._current: dict[str, str] = {}
        """Original request id -> its current attempt's id (migrated requests only)."""

    def current(self, request_id: str) -> str:
        """The id under which the request runs now."""
        return self._current.get(request_id, request_id)

    def forget(self, request_id: str) -> None:
        """The request (by its original id) is over."""
        self._current.pop(request_id, None)

    def allowed(self, migrations: int) -> bool:
        return migrations < self.limit

    def moved(self, request_id: str, new_id: str, pool: str, worker: str, reason: str) -> None:
        """Record the request's move off ``worker``: it runs as ``new_id`` from now on."""
        self._current[request_id] = new_id
        self.metrics.request_migrations.labels(*self.metrics.labels(pool, worker), reason).inc()
