"""What the API server knows of each worker and of each request in flight.

The worker client (client.py) keeps one WorkerState per worker (its sockets, its last load
report, what the router has sent it since) and one Tracked per engine request (where it
runs, how far it got); the router sees workers as the Candidates these produce.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from splitserve.router.policy import Candidate
from splitserve.services import messages as msg

if TYPE_CHECKING:
    from splitserve.services.api.client import RequestGroup

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
"""A prefill worker's assumed prompt throughput until its load reports measured one."""


@dataclass(frozen=True)
class WorkerEndpoint:
    worker_id: str
    request_addr: str
    output_addr: str
    role: str = "both"
    kv_addr: str = ""


@dataclass
class Tracked:
    group: RequestGroup
    index: int
    worker: int
    start: float
    prefill: int | None = None
    pending_prefill: msg.Prefill | None = None
    first_token: bool = False
    sent: float = 0.0
    first_token_at: float = 0.0
    last_token_at: float = 0.0
    num_tokens: int = 0
    prefill_tokens: int = 0
    """The router's estimate of the prompt tokens its prompt worker must compute."""
    vision: int | None = None
    """The vision worker encoding its images, until its prompt is done."""

    @property
    def prompt_worker(self) -> int:
        """The worker that computes the prompt: the prefill worker, or the only one."""
        return self.worker if self.prefill is None else self.prefill


@dataclass
class WorkerState:
    endpoint: WorkerEndpoint
    socket: zmq.Socket
    last_stats: msg.WorkerStats | None = None
    last_seen: float = field(default=-1e9)
    inflight: int = 0
    blocks_since_stats: int = 0
    draining: bool = False
    removed: bool = False
    prefill_tokens: int = 0
    """Estimated prompt tokens of the requests sent here whose first token has not come."""

    @property
    def pool(self) -> str:
        """Worker ids are `<pool>-<index>`."""
        return self.endpoint.worker_id.rsplit("-", 1)[0]

    @property
    def routable(self) -> bool:
        return not (self.draining or self.removed)

    def state(self, now: float, timeout_s: float) -> str:
        if self.draining:
            return "draining"
        if self.last_stats is None:
            return "starting"
        return "ready" if self.healthy(now, timeout_s) else "unhealthy"

    def healthy(self, now: float, timeout_s: float) -> bool:
        return now - self.last_seen < timeout_s

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
        )


def with_rates(candidates: list[Candidate]) -> list[Candidate]:
    """Every worker of a pool gets the pool's mean measured prefill rate.

    The replicas of a pool run on the same kind of device, so their true rates are equal;
    what one worker measures alone depends on its recent load (a busier worker batches more
    prompts per step and measures a higher rate), and routing on that would send it still
    more: the busiest worker would look fastest. The mean keeps costs in seconds without that
    loop.

    NOTE: candidates carry no node_id, so a worker is credited only with the prefix its own
    tiers (device, host) hold; a prefix on the node's shared disk tier is what any worker
    finds there when it runs the request, not a reason to route it somewhere."""
    measured = [c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s > 0]
    rate = sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S
    return [dataclasses.replace(c, prefill_tokens_per_s=rate) for c in candidates]
