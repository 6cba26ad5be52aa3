"""Router plans: a prefill and a decode worker per request, unhealthy workers skipped."""

from __future__ import annotations

from splitserve.router.policy import Candidate, RequestInfo
from splitserve.router.router import Plan, Router

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
    from splitserve.services.api.worker_view import DEFAULT_PREFILL_TOKENS_PER_S, with_rates

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
