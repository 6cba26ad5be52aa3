"""What the API server knows of each worker and of each request in flight.

The worker pool (worker_pool.py) keeps one WorkerState per worker: its socket, its last load
report and what the exchange has sent it since; the router sees workers as the Candidates
these produce. The request exchange (exchange.py) keeps one Tracked per engine request: where
it runs and how far it got.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from splitserve.router.policy import Candidate
from splitserve.services import messages as msg
from splitserve.services.api.submission import Submission

if TYPE_CHECKING:
    from splitserve.services.api.request_group import RequestGroup


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    request_addr: str
    output_addr: str
    role: str = "both"
    kv_addr: str = ""


@dataclass(eq=False)
class WorkerState:
    """One worker as the API server sees it; compared by identity (one per worker)."""

    endpoint: WorkerEndpoint
    socket: zmq.Socket
    last_stats: msg.WorkerStats | None = None
    last_seen: float = field(default=-1e9)
    inflight: int = 0
    """Requests sent here that wait on it: a decode worker's until they finish, a vision
    worker's until their prompt is done."""
    prompts: int = 0
    """A prefill worker's requests whose first token has not come."""
    blocks_since_stats: int = 0
    draining: bool = False
    removed: bool = False
    failed: str | None = None
    """Why the worker's loop stopped (its WorkerFailed); None while it runs."""
    loop_busy_s: float = 0.0
    """How long the worker's loop had been in its current round at its last Heartbeat."""
    prefill_tokens: int = 0
    """Estimated prompt tokens of the requests sent here whose first token has not come."""

    @property
    def worker_id(self) -> str:
        return self.endpoint.worker_id

    @property
    def pool(self) -> str:
        """Worker ids are `<pool>-<index>`, and `<pool>-<index>.<rank>` for the ranks of an
        expert-parallel group."""
        return self.endpoint.worker_id.rsplit("-", 1)[0]

    @property
    def group(self) -> str:
        """The replica it belongs to: `<pool>-<index>` (a rank's expert-parallel group)."""
        return self.endpoint.worker_id.partition(".")[0]

    @property
    def routable(self) -> bool:
        return not (self.draining or self.removed or self.failed is not None)

    @property
    def busy(self) -> bool:
        """Some request in flight still waits on this worker."""
        return self.inflight > 0 or self.prompts > 0

    def state(self, now: float, timeout_s: float) -> str:
        if self.draining:
            return "draining"
        if self.last_stats is None and self.failed is None:
            return "starting"
        return "ready" if self.healthy(now, timeout_s) else "unhealthy"

    def healthy(self, now: float, timeout_s: float) -> bool:
        """A recent heartbeat, and no report that its loop stopped."""
        return self.failed is None and now - self.last_seen < timeout_s

    def candidate(self, now: float, timeout_s: float) -> Candidate:
        stats = self.last_stats
        return Candidate(
            worker_id=self.endpoint.worker_id,
            num_free_blocks=(stats.num_free_blocks if stats else 0) - self.blocks_since_stats,
            num_running=stats.num_running if stats else 0,
            inflight=self.inflight,
            healthy=self.healthy(now, timeout_s),
            queued_tokens=max(stats.queued_tokens if stats else 0, self.prefill_tokens),
            prefill_tokens_per_s=stats.prefill_tokens_per_s if stats else 0.0,
            node_id=stats.node_id if stats else "",
        )


@dataclass
class Tracked:
    group: RequestGroup
    index: int
    worker: WorkerState
    """The decode (or colocated) worker."""
    start: float
    prefill: WorkerState | None = None
    pending_prefill: msg.Prefill | None = None
    """The Prefill to send once the decode worker answers Reserved."""
    first_token: bool = False
    sent: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_tokens: int = 0
    prefill_tokens: int = 0
    """The router's estimate of the prompt tokens its prompt worker must compute."""
    vision: WorkerState | None = None
    """The vision worker encoding its images, until its prompt is done."""
    prompt_done: bool = False
    """Its current attempt's first token came (or it ended): its prefill and vision workers
    are done with it."""
    request_id: str = ""
    """The id it was admitted under (an attempt after a migration has an id of its own)."""
    submission: Submission | None = None
    """What was sent for it at admission, to send again if it migrates (migration.py)."""
    token_ids: list[int] = field(default_factory=list)
    """The tokens its client has been sent."""
    text_chars: int = 0
    """The characters of text its client has been sent."""
    migrations: int = 0
    deadline: float = math.inf
    """When the API server ends it with a 504 (time.monotonic; server.request_timeout_s)."""

    def hops(self) -> list[WorkerState]:
        """The workers that hold something of its current attempt."""
        hops = [self.worker]
        if self.prefill is not None and self.pending_prefill is None:
            hops.append(self.prefill)
        if self.vision is not None:
            hops.append(self.vision)
        return hops

    def new_attempt(self, decode: WorkerState) -> None:
        """It migrates: its next attempt decodes on ``decode``; its other hops are chosen anew."""
        self.worker = decode
        self.prefill = self.vision = self.pending_prefill = None
        self.prompt_done = False
        self.prefill_tokens = 0
        self.migrations += 1

    @property
    def prompt_worker(self) -> WorkerState:
        """The worker that computes the prompt: the prefill worker, or the only one."""
        return self.worker if self.prefill is None else self.prefill

    def waits_on(self, worker: WorkerState) -> bool:
        """Whether this request cannot finish without ``worker``: its decode worker always,
        its prefill and vision workers until its (current attempt's) first token."""
        if worker is self.worker or worker is self.vision:
            return True
        return worker is self.prefill and not self.prompt_done
