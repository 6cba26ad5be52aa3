"""Routing policies: hand-computed costs pick the expected replica; ties are deterministic."""

from __future__ import annotations

import pytest

from splitserve.router.policy import (
    Candidate,
    RequestInfo,
    make_policy,
    prefill_cost,
)

PROMPT = list(range(100))  # 100 tokens, block size 16: at most 6 reusable blocks


def request(cached: dict[str, int] | None = None) -> RequestInfo:
    return RequestInfo("r0", PROMPT, block_size=16, cached_blocks=cached or {})


def test_cached_tokens_are_the_workers_own_blocks_and_leave_the_last_token() -> None:
    """Its node's disk tier (n0) is not its own cache: any worker of the node loads it."""
    worker = Candidate("p0", node_id="n0")
    assert request({"p0": 2, "n0": 4}).cached_tokens(worker) == 32
    assert request({"p0": 7}).cached_tokens(worker) == 96
    assert request({"n0": 5}).cached_tokens(worker) == 0
    assert RequestInfo("r", list(range(32)), 16, {"p0": 2}).cached_tokens(worker) == 16


def test_prefill_cost_is_queued_plus_uncached_tokens_over_the_rate() -> None:
    worker = Candidate("p0", queued_tokens=300, prefill_tokens_per_s=200.0)
    assert prefill_cost(worker, request()) == (300 + 100) / 200
    assert prefill_cost(worker, request({"p0": 4})) == (300 + 36) / 200


def test_cache_aware_prefers_the_replica_holding_the_prefix() -> None:
    replicas = [
        Candidate("p0", queued_tokens=50, prefill_tokens_per_s=1000.0),
        Candidate("p1", queued_tokens=50, prefill_tokens_per_s=1000.0, node_id="n1"),
    ]
    policy = make_policy("cache_aware")
    assert policy.choose_prefill(replicas, request()) == 0
    assert policy.choose_prefill(replicas, request({"p1": 3})) == 1  # 98 vs 150 tokens
    # Its node's disk tier alone, with no live peer to pull it through, does not attract it.
    assert policy.choose_prefill(replicas, request({"n1": 3})) == 0


def test_cache_aware_leaves_a_saturated_replica_despite_its_cache() -> None:
    replicas = [
        Candidate("p0", queued_tokens=0, prefill_tokens_per_s=1000.0),
        Candidate("p1", queued_tokens=5000, prefill_tokens_per_s=1000.0),
    ]
    cached = request({"p1": 6})  # p1: (5000 + 4) / 1000 = 5.004 s; p0: 100 / 1000 = 0.1 s
    assert make_policy("cache_aware").choose_prefill(replicas, cached) == 0


def test_cache_aware_weighs_the_prefill_rate() -> None:
    replicas = [
        Candidate("slow", queued_tokens=0, prefill_tokens_per_s=100.0),
        Candidate("fast", queued_tokens=200, prefill_tokens_per_s=1000.0),
    ]
    # slow: 100 / 100 = 1.0 s; fast: (200 + 100) / 1000 = 0.3 s
    assert make_policy("cache_aware").choose_prefill(replicas, request()) == 1


def test_equal_costs_go_to_the_earliest_candidate() -> None:
    replicas = [Candidate(f"p{i}", queued_tokens=10, prefill_tokens_per_s=10.0) for i in range(3)]
    assert make_policy("cache_aware").choose_prefill(replicas, request({"p1": 0})) == 0
    assert make_policy("cache_aware").choose_decode(replicas, request()) == 0
    assert make_policy("least_loaded").choose(replicas, request()) == 0


def test_decode_goes_to_the_most_free_blocks_then_the_fewest_running() -> None:
    replicas = [
        Candidate("d0", num_free_blocks=10, num_running=1),
        Candidate("d1", num_free_blocks=30, num_running=9),
        Candidate("d2", num_free_blocks=30, num_running=4),
    ]
    assert make_policy("cache_aware").choose_decode(replicas, request()) == 2


def test_least_loaded_counts_inflight_then_queue_then_free_blocks() -> None:
    replicas = [
        Candidate("w0", inflight=3, queued_tokens=0),
        Candidate("w1", inflight=2, queued_tokens=500, num_free_blocks=1),
        Candidate("w2", inflight=2, queued_tokens=500, num_free_blocks=9),
    ]
    assert make_policy("least_loaded").choose(replicas, request({"w0": 6})) == 2


def test_round_robin_cycles_prefill_and_decode_separately() -> None:
    replicas = [Candidate("a"), Candidate("b"), Candidate("c")]
    policy = make_policy("round_robin")
    picks = [policy.choose_prefill(replicas, request()) for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    assert policy.choose_decode(replicas, request()) == 0


def test_unknown_policy_and_empty_candidates_are_errors() -> None:
    with pytest.raises(ValueError, match="expected one of cache_aware, least_loaded, round_robin"):
        make_policy("random")
    with pytest.raises(ValueError, match="no candidate workers"):
        make_policy("cache_aware").choose([], request())


def test_what_a_live_peer_holds_is_pulled_at_a_small_cost() -> None:
    """p1 lacks the prefix but could pull p0's 6 blocks (96 tokens) at PULL_COST each: at
    equal queues the holder wins, once the holder's queue is longer by more than the pull
    cost the other replica takes the request (and pulls), instead of waiting for p0."""
    from splitserve.router.policy import PULL_COST

    pullable = RequestInfo("r0", PROMPT, 16, {"p0": 6}, peers={"p0": 6, "p1": 0})
    holder = Candidate("p0", queued_tokens=40, prefill_tokens_per_s=1000.0)
    other = Candidate("p1", queued_tokens=40, prefill_tokens_per_s=1000.0)
    assert pullable.pullable_tokens(other) == 96 and pullable.pullable_tokens(holder) == 0
    assert prefill_cost(other, pullable) == pytest.approx((40 + 4 + PULL_COST * 96) / 1000)
    policy = make_policy("cache_aware")
    assert policy.choose_prefill([holder, other], pullable) == 0
    busy = Candidate("p0", queued_tokens=60, prefill_tokens_per_s=1000.0)
    assert policy.choose_prefill([busy, other], pullable) == 1
    # Without peers (an image prompt, or one replica) p1 would have to compute all 100.
    alone = RequestInfo("r0", PROMPT, 16, {"p0": 6})
    assert policy.choose_prefill([busy, other], alone) == 0
