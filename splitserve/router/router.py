"""The router: where each request goes, decided by a pure function of what the API server knows.

``Router.route`` takes the request (prompt ids, block size, its images' hashes or None), the
prefix index's answer (holder -> leading blocks of the prompt cached there) and the routable
workers of each pool as Candidates (load, health, node), and returns a Route: the decode
worker, the prefill worker (None when colocated), the peer that prefill worker pulls the
prefix from, the vision worker, and the prompt tokens the prefill worker is expected to
compute. It sends nothing and records nothing; the only state is the policies' own (round-robin
turns, which vision worker took which image), so the same calls in the same order give the
same routes.

Colocated deployments have one pool of `both` workers, chosen like decode workers;
disaggregated ones pick a prefill worker and a decode worker. Workers whose heartbeat stopped
are skipped while any healthy one is left.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from splitserve.router.policy import Candidate, Policy, RequestInfo, make_policy
from splitserve.router.prefix_lookup import best_peer, holds
from splitserve.router.vision import VisionRouter

DEFAULT_PREFILL_TOKENS_PER_S = 2000.0
"""A prefill worker's assumed prompt throughput until its load reports measured one."""


@dataclass(frozen=True)
class Plan:
    """Indices of the chosen workers in their candidate lists; prefill is None if colocated."""

    prefill: int | None
    decode: int


@dataclass(frozen=True)
class RouteRequest:
    """What the router knows of a request when it arrives."""

    request_id: str
    prompt_ids: Sequence[int]
    block_size: int
    cached_blocks: Mapping[str, int]
    """The prefix index's answer: holder (worker or node id) -> leading prompt blocks there;
    empty when the index was not asked or could not answer."""
    image_hashes: Sequence[str] | None = None
    """The content hashes of the prompt's images; None for a prompt without images."""


@dataclass(frozen=True)
class Pools:
    """The workers that take new requests, per pool, oldest first."""

    decode: Sequence[Candidate]
    """Decode workers, or the colocated (`both`) ones."""
    prefill: Sequence[Candidate] = ()
    vision: Sequence[Candidate] = ()


@dataclass(frozen=True)
class Peer:
    """A prefill worker to pull the prompt's first ``blocks`` blocks from."""

    worker_id: str
    blocks: int


@dataclass(frozen=True)
class Route:
    """Where a request goes (worker ids)."""

    decode: str
    prefill: str | None = None
    """None: the decode worker computes the prompt itself (colocated)."""
    peer: Peer | None = None
    vision: str | None = None
    prefill_tokens: int = 0
    """Prompt tokens the prefill worker is expected to compute (0 when colocated)."""


class NoWorkerError(ValueError):
    """A pool that the request needs has no worker taking requests."""

    def __init__(self, pool: str) -> None:
        super().__init__(f"no {pool} worker is taking requests")
        self.pool = pool


class Router:
    def __init__(self, prefill_policy: str = "round_robin", decode_policy: str = "least_loaded"):
        self.prefill_policy: Policy = make_policy(prefill_policy)
        self.decode_policy: Policy = make_policy(decode_policy)
        self.vision = VisionRouter()

    def wants_prefix(self, prefill_workers: int) -> bool:
        """Whether the prefix index's answer is worth a lookup: cache-aware costing uses it,
        and with two or more prefill workers so does the choice of a peer to pull from."""
        return self.prefill_policy.name == "cache_aware" or prefill_workers >= 2

    def plan(
        self,
        request: RequestInfo,
        decode: Sequence[Candidate],
        prefill: Sequence[Candidate] = (),
    ) -> Plan:
        """The prefill and decode choice alone, as indices into the candidate lists."""
        prefill_index = (
            _choose(self.prefill_policy.choose_prefill, prefill, request) if prefill else None
        )
        return Plan(prefill_index, _choose(self.decode_policy.choose_decode, decode, request))

    def route(self, request: RouteRequest, pools: Pools) -> Route:
        """The whole decision for one request; NoWorkerError when a pool it needs is empty."""
        text_only = request.image_hashes is None
        if not pools.decode:
            raise NoWorkerError("decode")
        if not text_only and pools.prefill and not pools.vision:
            raise NoWorkerError("vision")
        prefill = with_rates(pools.prefill)
        peers = pullable(request.cached_blocks, prefill) if text_only else {}
        info = RequestInfo(
            request.request_id, request.prompt_ids, request.block_size, request.cached_blocks, peers
        )
        plan = self.plan(info, pools.decode, prefill)
        decode = pools.decode[plan.decode].worker_id
        if plan.prefill is None:
            return Route(decode)
        chosen = prefill[plan.prefill]
        have = info.cached_tokens(chosen) + info.pullable_tokens(chosen)
        tokens = len(request.prompt_ids) - have
        if request.image_hashes is None:
            return Route(decode, chosen.worker_id, peer_of(info, prefill, chosen), None, tokens)
        vision = pools.vision[self.vision.choose(pools.vision, request.image_hashes)]
        return Route(decode, chosen.worker_id, None, vision.worker_id, tokens)


def with_rates(candidates: Sequence[Candidate]) -> list[Candidate]:
    """Every worker of a pool gets the pool's mean measured prefill rate.

    The replicas of a pool run on the same kind of device, so their true rates are equal;
    what one worker measures alone depends on its recent load (a busier worker batches more
    prompts per step and measures a higher rate), and routing on that would send it still
    more: the busiest worker would look fastest. The mean keeps costs in seconds without that
    loop."""
    measured = [c.prefill_tokens_per_s for c in candidates if c.prefill_tokens_per_s > 0]
    rate = sum(measured) / len(measured) if measured else DEFAULT_PREFILL_TOKENS_PER_S
    return [dataclasses.replace(c, prefill_tokens_per_s=rate) for c in candidates]


def pullable(cached_blocks: Mapping[str, int], prefill: Sequence[Candidate]) -> dict[str, int]:
    """Healthy prefill worker -> the prompt's leading blocks it could send to a peer; empty
    without an index answer or with fewer than two prefill workers."""
    if not cached_blocks or len(prefill) < 2:
        return {}
    return {c.worker_id: holds(cached_blocks, c) for c in prefill if c.healthy}


def peer_of(info: RequestInfo, prefill: Sequence[Candidate], chosen: Candidate) -> Peer | None:
    """A healthy prefill worker holding more of the prompt than the chosen one and its node's
    disk tier: the chosen one pulls the difference from it (services/workers/peer_blocks.py).
    A peer serves from its device cache and its block store, whose disk tier is its node's:
    a prefix on another node's disk is pulled through a worker of that node."""
    if not info.cached_blocks:
        return None
    others = [c for c in prefill if c.worker_id != chosen.worker_id and c.healthy]
    offers = {c.worker_id: holds(info.cached_blocks, c) for c in others}
    usable = max(len(info.prompt_ids) - 1, 0) // info.block_size
    found = best_peer(offers, holds(info.cached_blocks, chosen), offers, usable)
    return None if found is None else Peer(*found)


def _choose(
    choose: Callable[[Sequence[Candidate], RequestInfo], int],
    candidates: Sequence[Candidate],
    request: RequestInfo,
) -> int:
    healthy = [i for i, c in enumerate(candidates) if c.healthy]
    if not healthy or len(healthy) == len(candidates):
        return choose(candidates, request)
    return healthy[choose([candidates[i] for i in healthy], request)]
