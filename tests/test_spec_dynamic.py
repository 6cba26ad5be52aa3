"""Dynamic verification (engine/spec/dynamic.py): exact decisions on given step-time curves
and acceptance estimates, and the speculator's use of them."""

from __future__ import annotations

import itertools
import math
import types
from collections.abc import Callable

import pytest
import torch

from splitserve.engine import warm_up
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec import speculator as module
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.spec.dynamic import Acceptance, Evidence, StepCurve, plan_drafts
from splitserve.engine.spec.ngram import NgramDrafter
from splitserve.engine.warm_up import rows_to_time

CPU_MS = {1: 6.1, 2: 6.4, 3: 7.8, 4: 9.35, 5: 11.0, 6: 19.2, 7: 22.6, 8: 26.8, 9: 30.8, 16: 30.1}
"""SmolLM2 decode steps on one thread of the 2-core VM by rows (ms): a step of 5 rows costs
1.8 steps of one, a step of 9 five."""
CURVE = StepCurve({rows: ms / 1000 for rows, ms in CPU_MS.items()})


def _rows(batch: int) -> Callable[[int, int], float]:
    return lambda drafts, longest: CURVE.seconds(batch + drafts)


def _geometric(a: float, k: int = 8) -> list[float]:
    return [a**j for j in range(1, k + 1)]


def test_drafts_always_accepted_verify_the_best_fixed_k_of_the_curve() -> None:
    # Tokens per ms at k = 2, 4, 8: 3 / 7.8, 5 / 11.0, 9 / 30.8: k = 4 is best, and planned.
    assert plan_drafts([[1.0] * 8], _rows(1)) == [4]


def test_drafts_almost_never_accepted_verify_none() -> None:
    assert plan_drafts([_geometric(0.02)], _rows(1)) == [0]


def test_middling_acceptance_verifies_the_drafts_worth_their_rows() -> None:
    # a = 0.5: one draft (1.5 tokens in 6.4 ms) beats two (1.75 in 7.8) and none (1 in 6.1).
    assert plan_drafts([_geometric(0.5)], _rows(1)) == [1]


def test_a_batch_gives_its_rows_to_the_requests_whose_drafts_are_accepted() -> None:
    # Rows 5 (three drafts) hold 5 tokens in 11.0 ms; a fourth draft reaches the 19.2 ms step.
    assert plan_drafts([[1.0] * 8, _geometric(0.02)], _rows(2)) == [3, 0]
    assert plan_drafts([_geometric(0.9), _geometric(0.9)], _rows(2), max_rows=4) == [1, 1]


def test_the_drafting_cost_of_a_draft_model_shortens_the_drafts() -> None:
    flat = StepCurve({1: 0.010, 64: 0.011})

    def with_passes(drafts: int, longest: int) -> float:
        return flat.seconds(1 + drafts) + 0.004 * longest  # a draft pass: 40% of a step

    assert plan_drafts([_geometric(0.99)], with_passes) == [8]
    # 1 + 0.8 + 0.64 tokens in 18 ms beat 1.8 in 14 and 2.95 in 22 (rows cost next to nothing).
    assert plan_drafts([_geometric(0.8)], with_passes) == [2]
    assert plan_drafts([_geometric(0.3)], with_passes) == [0]  # 1.3 tokens in 14 ms: < 1 in 10


def test_step_curve_interpolates_its_table_and_learns_from_real_steps() -> None:
    # A point timed while other work stalled the step (rows 2 above rows 3) is not kept.
    assert StepCurve({1: 0.0057, 2: 0.0092, 3: 0.0077}).seconds(2) == pytest.approx(0.0077)
    curve = StepCurve({1: 0.010, 5: 0.014, 9: 0.030})
    assert curve.seconds(3) == pytest.approx(0.012)
    assert curve.seconds(11) == pytest.approx(0.038)  # the last segment's slope
    curve.record(5, 0.019)  # 5 ms slower: the estimate takes 10%, a quarter of it shared
    assert curve.offset == pytest.approx(0.000125)
    assert curve.seconds(5) == pytest.approx(0.014 + 0.000125 + 0.0005)
    assert curve.seconds(1) == pytest.approx(0.010 + 0.000125)
    curve.record(1, 1.0)  # a stalled step counts as one of twice the estimate
    assert curve.correction[1] == pytest.approx(0.1 * (0.010 + 0.000125))
    assert curve.correction[5] == pytest.approx(0.0005 * 0.98)  # fading while not renewed
    estimate = curve.seconds(9)
    curve.record(9, 0.020)  # faster: 40% of the error, and a quarter of that again shared
    assert curve.seconds(9) == pytest.approx(estimate + 0.5 * (0.020 - estimate))


def test_a_request_that_stops_quoting_verifies_one_draft_until_one_is_accepted() -> None:
    rate = Acceptance()
    for _ in range(8):
        rate.record(4, 4)  # quoting its prompt: every draft accepted
    assert plan_drafts([rate.offer(8)], _rows(1)) == [4]
    assert rate.rate > 0.97
    rate.record(4, 0)  # writing freely: the first draft is rejected
    assert rate.offer(8) == [pytest.approx(0.9869, abs=1e-4)]
    assert plan_drafts([rate.offer(8)], _rows(1)) == [1]
    rate.record(1, 0)
    assert plan_drafts([rate.offer(8)], _rows(1)) == [1]  # one draft costs 5% of a step
    rate.record(1, 1)  # quoting again
    assert plan_drafts([rate.offer(8)], _rows(1)) == [4]


def test_a_first_draft_is_worth_its_mean_acceptance_plus_one_standard_deviation() -> None:
    assert Acceptance().offer(3) == pytest.approx([0.9683, 0.5136, 0.4445], abs=1e-4)
    assert Acceptance().offer(0) == []


EPYC_B8 = StepCurve({8: 0.0319, 72: 0.0319 + 64 * 0.00304})
"""SmolLM2 at batch 8 on one thread of the AMD EPYC VM: 31.9 ms, and 3.04 ms a further row
(a row costs three quarters of a token's share of the step)."""


def test_at_batch_8_a_first_draft_is_probed_where_the_mean_verifies_nothing() -> None:
    """Issue 49: planned from the mean, a request that copies its prompt was never verified,
    so its posterior never learned that every draft was right."""
    batch = lambda drafts, longest: EPYC_B8.seconds(8 + drafts)  # noqa: E731
    assert plan_drafts([Acceptance().values(8)] * 8, batch) == [0] * 8
    assert plan_drafts([Acceptance().offer(8)] * 8, batch) == [1] * 8
    compute_bound = StepCurve({8: 0.032, 72: 0.288})  # a row costs what a token does
    batch = lambda drafts, longest: compute_bound.seconds(8 + drafts)  # noqa: E731
    assert plan_drafts([Acceptance().offer(8)] * 8, batch) == [0] * 8


def test_the_pool_lends_a_new_request_at_most_four_verifications_of_evidence() -> None:
    pool = Evidence()
    for _ in range(40):
        pool.add(8, 8)
    own = Acceptance()
    for _ in range(4):
        own.own.add(8, 8)
    assert Acceptance(pool).weights == pytest.approx(own.weights)
    quoting = Acceptance(Evidence())
    quoting.record(8, 8)  # one request's evidence reaches the pool, and a new one's prior
    assert quoting.pool is not None
    assert Acceptance(quoting.pool).offer(8)[7] == pytest.approx(0.7120, abs=1e-4)


def _batch_tokens_per_second(accepted: list[list[int]], fixed: int | None) -> float:
    """Eight requests on ``EPYC_B8`` for len(accepted) steps; accepted[step][i]: how many of
    request i's 8 drafts are right (-1: none offered). fixed: verify that many (None: plan)."""
    rates = [Acceptance(pool) for pool in [Evidence()] for _ in range(8)]
    tokens, seconds = 0, 0.0
    for right in accepted:
        caps = [8 if n >= 0 else 0 for n in right]
        if fixed is None:
            offers = [rate.offer(cap) for rate, cap in zip(rates, caps)]
            limits = plan_drafts(offers, lambda drafts, longest: EPYC_B8.seconds(8 + drafts))
        else:
            limits = [min(fixed, cap) for cap in caps]
        for rate, limit, n in zip(rates, limits, right):
            kept = min(limit, max(n, 0))
            tokens += 1 + kept
            rate.record(limit, kept) if limit else rate.idle()
        seconds += EPYC_B8.seconds(8 + sum(limits))
    return tokens / seconds


def test_a_batch_of_8_copying_reaches_the_best_fixed_k_and_free_text_plain_decoding() -> None:
    """Issue 49's batch-8 targets on a model of the CPU: copying (every draft right, twelve
    steps, as long as the copy workload's requests at k = 8) and free text (drafts offered
    every other or third step, or every step, and never right)."""
    copying = [[8] * 8] * 12
    best = max(_batch_tokens_per_second(copying, k) for k in (2, 4, 8))
    assert _batch_tokens_per_second(copying, None) >= 0.95 * best
    for every in (1, 2, 3):
        free = [[0 if (step + i) % every == 0 else -1 for i in range(8)] for step in range(40)]
        assert _batch_tokens_per_second(free, None) >= 0.98 * _batch_tokens_per_second(free, 0)


def _decoding(name: str, tokens: list[int]) -> Request:
    req = Request(name, tokens, SamplingParams(max_tokens=100))
    req.num_computed_tokens = req.num_tokens - 1
    return req


def test_overlapped_plain_steps_are_priced_by_their_own_curve(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps without drafts run overlapped (CUDA graphs, host work hidden): on an H200 several
    times cheaper than a synchronous verify step. Once measured, drafts stop paying."""
    spec = module.Speculator(SpeculativeConfig(num_speculative_tokens=4), NgramDrafter(1, 3), 512)
    spec.measure({1: 0.010, 16: 0.012, 80: 0.030}, overlapping=True)
    reqs = [_decoding(f"r{i}", list(range(10 * i, 10 * i + 20))) for i in range(16)]
    # New requests probe: one draft each (32 tokens if accepted, in 16.5 ms; 16 in 12 ms).
    assert spec.limits(reqs) == [1] * 16
    clock = itertools.count(1.0, 0.005)
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    for _ in range(21):
        spec.overlapped(reqs)  # twenty 5 ms steps (the first launch starts the clock)
    assert spec.overlapped_curve is not None
    assert spec.overlapped_curve.seconds(16) < 0.0055
    assert spec.curve.seconds(16) == pytest.approx(0.012)
    assert spec.limits(reqs) == [0] * 16


def test_an_overlapped_plain_step_is_priced_at_most_a_measured_verify_step() -> None:
    """The overlapped curve starts at the start-up table (eager steps: on a GPU far above the
    graphs' steps) and learns only from two plain steps in a row. Priced from it, a verify step
    measured below the table looked cheaper than plain decoding: drafts never accepted were
    verified every step, and two plain steps never ran (issue 49 on an H200: 0.72x of plain)."""
    spec = module.Speculator(SpeculativeConfig(num_speculative_tokens=4), NgramDrafter(1, 3), 512)
    spec.measure({1: 0.007, 16: 0.0073}, overlapping=True)
    spec.pass_seconds = 0.0007
    assert spec.curve.least_measured(1) == math.inf
    for _ in range(10):
        spec.curve.record(2, 0.0048)  # graphs: 4.8 ms, the table 7 ms
    assert spec.curve.least_measured(2) == math.inf
    assert spec.curve.least_measured(1) == pytest.approx(0.0048, abs=2e-5)
    rejecting = _decoding("r", list(range(20)))
    for _ in range(10):
        spec._acceptance(rejecting).record(1, 0)
    assert spec.limits([rejecting]) == [0]  # a draft worth 0.13 tokens pays no 0.7 ms pass


def test_a_lookup_drafts_all_it_can_and_verifies_what_the_plan_keeps() -> None:
    """The n-gram lookup costs nothing per draft: it is asked for k, and the plan is made
    again over the drafts found (a request without any leaves its rows to the others)."""
    spec = module.Speculator(SpeculativeConfig(num_speculative_tokens=8), NgramDrafter(2, 3), 512)
    spec.measure({rows: ms / 1000 for rows, ms in CPU_MS.items()}, overlapping=False)
    quoting = _decoding("q", [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 5, 6, 7])
    free = _decoding("f", list(range(100, 120)))
    for req in (quoting, free):
        for _ in range(8):
            spec._acceptance(req).record(4, 4)
    spec.propose([quoting, free])
    assert free.draft_token_ids == []
    assert quoting.draft_token_ids == [8, 9, 10]  # rows 5 of the curve: three drafts


def test_the_curve_is_timed_at_every_small_row_count_and_sparser_above() -> None:
    assert rows_to_time(5) == [1, 2, 3, 4, 5]
    assert rows_to_time(72)[22:] == [23, 24, 32, 40, 48, 56, 64, 72]
    assert rows_to_time(2304)[-3:] == [204, 229, 256]  # MOST_TIMED_ROWS; then its slope


def test_the_curve_keeps_each_count_fastest_pass_and_a_stall_hits_one_pass(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each row count is run untimed, then timed once a pass, passes in alternate order: a
    burst of other work (here the second and third timed runs) stalls different counts in
    each pass, and every count keeps a run from outside it."""
    run: list[int] = []
    now = [0.0]

    def forward(runner: object, rows: int, width: int, prefills: list[object]) -> None:
        run.append(rows)
        now[0] += 0.5 if len(run) in (5, 6) else 0.01 * rows  # runs 5 and 6: a stall

    monkeypatch.setattr(warm_up, "_forward", forward)
    monkeypatch.setattr(warm_up.time, "perf_counter", lambda: now[0])
    runner = types.SimpleNamespace(max_blocks_per_seq=4, device=torch.device("cpu"))
    curve = warm_up.time_decode_rows(runner, 3)  # type: ignore[arg-type]
    assert run == [1, 2, 3, 1, 2, 3, 3, 2, 1]
    assert curve == pytest.approx({1: 0.01, 2: 0.02, 3: 0.03})
