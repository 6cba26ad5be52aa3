"""Router plans and routes: a prefill and a decode worker per request, unhealthy workers
skipped; the whole route (decode, prefill, peer, vision, prefill tokens) from the prefix
index's answer and the candidates alone."""

from __future__ import annotations

import pytest

from splitserve.router.policy import Candidate, RequestInfo
from splitserve.router.router import (
    DEFAULT_PREFILL_TOKENS_PER_S,
    NoWorkerError,
    Peer,
    Plan,
    Pools,
    Route,
    Router,
    RouteRequest,
    with_rates,
)

REQUEST = RequestInfo("r", [1, 2, 3])


def cand(name: str, inflight: int = 0, ok: bool = True) -> Candidate:
    return Candidate(name, num_free_blocks=100, inflight=inflight, healthy=ok)


def test_prefill_round_robin_and_decode_least_loaded() -> None:
    router = Router()
    prefill = [cand("p0"), cand("p1")]
    decode = [cand("d0", inflight=3), cand("d1", inflight=1)]
    plans = [router.plan(REQUEST, decode, prefill) for _ in range(3)]
    assert plans == [Plan(0, 1), Plan(1, 1), Plan(0, 1)]


def test_colocated_plans_have_no_prefill_worker() -> None:
    assert Router().plan(REQUEST, [cand("w0", inflight=2), cand("w1")]) == Plan(None, 1)


def test_unhealthy_workers_are_skipped_while_a_healthy_one_is_left() -> None:
    router = Router()
    prefill = [cand("p0", ok=False), cand("p1"), cand("p2", ok=False)]
    decode = [cand("d0", ok=False), cand("d1", inflight=5)]
    assert [router.plan(REQUEST, decode, prefill) for _ in range(2)] == [Plan(1, 1)] * 2
    all_down = [cand("d0", inflight=1, ok=False), cand("d1", ok=False)]
    assert router.plan(REQUEST, all_down).decode == 1


def test_a_pool_is_costed_at_its_mean_measured_rate() -> None:
    """A busier replica batches more and measures a higher rate; routing on that would feed
    it more still. Every replica gets the pool's mean; with none measured, the default."""
    measured = with_rates(
        [
            Candidate("p0", prefill_tokens_per_s=300.0),
            Candidate("p1", prefill_tokens_per_s=100.0),
            Candidate("p2", prefill_tokens_per_s=0.0),
        ]
    )
    assert [c.prefill_tokens_per_s for c in measured] == [200.0, 200.0, 200.0]
    unmeasured = with_rates([Candidate(f"p{i}", prefill_tokens_per_s=0.0) for i in range(2)])
    assert {c.prefill_tokens_per_s for c in unmeasured} == {DEFAULT_PREFILL_TOKENS_PER_S}


PROMPT = list(range(100))  # block size 16: at most 6 reusable blocks
DECODE = [Candidate("d0", num_free_blocks=10), Candidate("d1", num_free_blocks=30)]


def text(cached: dict[str, int]) -> RouteRequest:
    return RouteRequest("r", PROMPT, 16, cached)


def prefill(name: str, queued: int = 0, node: str = "", ok: bool = True) -> Candidate:
    return Candidate(
        name, queued_tokens=queued, prefill_tokens_per_s=1000.0, node_id=node, healthy=ok
    )


def cache_aware() -> Router:
    return Router("cache_aware", "cache_aware")


def test_a_colocated_route_names_only_the_decode_worker() -> None:
    assert cache_aware().route(text({"d0": 6}), Pools(DECODE)) == Route("d1")


def test_the_prefix_holder_takes_the_prompt_until_pulling_its_prefix_elsewhere_is_cheaper() -> None:
    """p0 holds 6 blocks; p1 would pull them from p0 at PULL_COST a token (4.8 tokens' worth)."""
    router, cached = cache_aware(), {"p0": 6}
    idle = Pools(DECODE, [prefill("p0"), prefill("p1")])
    assert router.route(text(cached), idle) == Route("d1", "p0", None, None, 4)
    busy = Pools(DECODE, [prefill("p0", queued=40), prefill("p1")])  # 44 against 8.8 tokens
    assert router.route(text(cached), busy) == Route("d1", "p1", Peer("p0", 6), None, 4)


def test_a_prefix_on_another_nodes_disk_is_pulled_through_a_worker_of_that_node() -> None:
    pools = Pools(DECODE, [prefill("p0", node="node:a"), prefill("p1", node="node:b")])
    route = cache_aware().route(text({"node:b": 6}), pools)
    assert route == Route("d1", "p0", Peer("p1", 6), None, 4)


def test_the_chosen_workers_own_node_disk_needs_no_peer() -> None:
    pools = Pools(DECODE, [prefill("p0", node="node:a"), prefill("p1", queued=100)])
    route = cache_aware().route(text({"node:a": 6, "p1": 6}), pools)
    assert route == Route("d1", "p0", None, None, 4)


def test_an_unhealthy_worker_is_neither_chosen_nor_pulled_from() -> None:
    pools = Pools(DECODE, [prefill("p0", node="node:a"), prefill("p1", node="node:b", ok=False)])
    assert cache_aware().route(text({"node:b": 6}), pools) == Route("d1", "p0", None, None, 100)


def test_an_image_prompt_is_not_pulled_and_goes_to_the_least_busy_vision_worker() -> None:
    router = cache_aware()
    visions = [Candidate("v0", inflight=1), Candidate("v1")]
    pools = Pools(DECODE, [prefill("p0"), prefill("p1", queued=40)], visions)
    image = RouteRequest("r", PROMPT, 16, {"p0": 6}, ["img"])
    assert router.route(image, pools) == Route("d1", "p0", None, "v1", 4)
    # Equally busy now: the image goes back to the worker that encoded it last.
    both_busy = Pools(
        DECODE, pools.prefill, [Candidate("v0", inflight=1), Candidate("v1", inflight=1)]
    )
    assert router.route(image, both_busy).vision == "v1"


def test_round_robin_routes_take_turns() -> None:
    router, pools = Router(), Pools(DECODE, [prefill("p0"), prefill("p1")])
    picks = [router.route(text({}), pools).prefill for _ in range(3)]
    assert picks == ["p0", "p1", "p0"]


def test_a_pool_the_request_needs_without_workers_is_an_error() -> None:
    with pytest.raises(NoWorkerError, match="no decode worker is taking requests"):
        cache_aware().route(text({}), Pools([], [prefill("p0")]))
    image = RouteRequest("r", PROMPT, 16, {}, ["img"])
    with pytest.raises(NoWorkerError, match="no vision worker is taking requests"):
        cache_aware().route(image, Pools(DECODE, [prefill("p0")]))


def test_the_prefix_index_is_asked_only_when_the_route_uses_its_answer() -> None:
    assert cache_aware().wants_prefix(1)
    assert not Router("round_robin", "least_loaded").wants_prefix(1)
    assert Router("round_robin", "least_loaded").wants_prefix(2)
