"""Routing policies: which replica of a pool takes a request.

A policy picks an index into a list of candidates (the router drops unhealthy ones first).
``choose_prefill`` and ``choose_decode`` default to ``choose``; ``cache_aware`` tells them apart:

- prefill: the smallest estimated time until this request's prefill would finish,
  (queued tokens + prompt tokens not cached there) / prefill rate. A worker counts as caching
  the longest prefix its own tiers (device, host) hold (RequestInfo.cached_blocks, from the
  prefix index); what it lacks but a live peer holds (RequestInfo.peers: the peer's own tiers
  or its node's disk tier) it would pull, at PULL_COST of computing it. With no index answer
  (Redis away) this is load only.
- decode: the most free KV blocks, then the fewest running sequences.

``least_loaded`` ignores the cache and ``round_robin`` ignores everything. Ties go to the earliest
candidate, so every decision is deterministic.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Candidate:
    """A worker's latest load as the router sees it."""

    worker_id: str
    num_free_blocks: int = 0
    num_running: int = 0
    inflight: int = 0
    """Requests the router sent there that have not finished."""
    healthy: bool = True
    queued_tokens: int = 0
    """Prompt tokens waiting for prefill there."""
    prefill_tokens_per_s: float = 1.0
    node_id: str = ""
    """The holder id of the disk tier the worker shares with its node's workers ("" without
    one; from its WorkerStats). It decides what the worker can send to a peer (holds), not
    what the worker itself is credited with (cached_tokens)."""


@dataclass(frozen=True)
class RequestInfo:
    """What the router knows of a request when placing it."""

    request_id: str
    prompt_ids: Sequence[int]
    block_size: int = 16
    cached_blocks: Mapping[str, int] = field(default_factory=dict)
    """Holder (worker or node id) -> leading prompt blocks cached there (PrefixIndex)."""

    peers: Mapping[str, int] = field(default_factory=dict)
    """Live prefill worker -> leading prompt blocks it can send to another worker that pulls
    them (services/workers/peer_blocks.py): its own tiers' and its node's disk tier's. Empty
    when the request cannot be pulled (image prompts) or there is no index answer."""

    def pullable_tokens(self, worker: Candidate) -> int:
        """Prompt tokens beyond ``worker``'s own cached prefix that it would pull from the
        live worker holding the longest prefix."""
        best = max((n for peer, n in self.peers.items() if peer != worker.worker_id), default=0)
        usable = max(len(self.prompt_ids) - 1, 0) // self.block_size
        return max(min(best, usable) * self.block_size - self.cached_tokens(worker), 0)

    def cached_tokens(self, worker: Candidate) -> int:
        """Prompt tokens ``worker`` need not compute: the longest prefix its own tiers hold.

        Its node's disk tier is not counted: every worker of the node can load it, so it does
        not tell the node's replicas apart, and crediting it would let the earliest replica
        win over the one holding the prefix on its device. Capped like the engine's prefix
        reuse, which always computes the last prompt token.
        """
        blocks = self.cached_blocks.get(worker.worker_id, 0)
        usable = max(len(self.prompt_ids) - 1, 0) // self.block_size
        return min(blocks, usable) * self.block_size


class Policy(ABC):
    """Chooses one of a non-empty list of candidates that can all take the request."""

    name: str

    @abstractmethod
    def choose(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        """Index of the chosen candidate."""

    def choose_prefill(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        """Index of the prefill replica."""
        return self.choose(candidates, request)

    def choose_decode(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        """Index of the decode (or colocated) replica."""
        return self.choose(candidates, request)


PULL_COST = 0.05
"""A token of KV pulled from a peer, as a fraction of the cost of computing it: moving one
token's K and V over the transport is tens of times cheaper than the matmuls that make it
(SmolLM2 on one CPU core: ~50 us against ~4 ms; Llama-3-8B on an H200: ~1 us against ~30 us).
Small but not zero, so that of two equally loaded workers the one holding the prefix wins."""


def prefill_cost(worker: Candidate, request: RequestInfo) -> float:
    """Seconds until this request's prefill would finish on ``worker``: its queue, the prompt
    tokens it must compute, and those it would pull from a peer at PULL_COST each."""
    pulled = request.pullable_tokens(worker)
    computed = len(request.prompt_ids) - request.cached_tokens(worker) - pulled
    work = worker.queued_tokens + computed + PULL_COST * pulled
    return work / worker.prefill_tokens_per_s


def argmin(candidates: Sequence[Candidate], key: Callable[[Candidate], Any]) -> int:
    """Index of the candidate with the smallest key; the earliest one on ties."""
    if not candidates:
        raise ValueError("no candidate workers")
    return min(range(len(candidates)), key=lambda i: (key(candidates[i]), i))


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def choose(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        return argmin(candidates, lambda w: prefill_cost(w, request))

    def choose_decode(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        return argmin(candidates, lambda w: (-w.num_free_blocks, w.num_running))


class LeastLoadedPolicy(Policy):
    """Fewest requests in flight, then fewest queued tokens, then most free KV blocks."""

    name = "least_loaded"

    def choose(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        return argmin(candidates, lambda w: (w.inflight, w.queued_tokens, -w.num_free_blocks))


class RoundRobinPolicy(Policy):
    """Cycles through the candidates; prefill and decode keep separate turns."""

    name = "round_robin"

    def __init__(self) -> None:
        self._turn = itertools.count()
        self._decode_turn = itertools.count()

    def choose(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        return _nth(candidates, next(self._turn))

    def choose_decode(self, candidates: Sequence[Candidate], request: RequestInfo) -> int:
        return _nth(candidates, next(self._decode_turn))


def _nth(candidates: Sequence[Candidate], turn: int) -> int:
    if not candidates:
        raise ValueError("no candidate workers")
    return turn % len(candidates)


POLICIES: dict[str, type[Policy]] = {
    cls.name: cls for cls in (CacheAwarePolicy, LeastLoadedPolicy, RoundRobinPolicy)
}


def make_policy(name: str = "cache_aware") -> Policy:
    """The policy named by ``router.policy``."""
    if name not in POLICIES:
        raise ValueError(f"router.policy {name!r}: expected one of {', '.join(POLICIES)}")
    return POLICIES[name]()
