"""The load generator's arithmetic against values computed by hand."""

from __future__ import annotations

import math

import pytest

from splitserve.bench.client import RequestResult
from splitserve.bench.load import send_times
from splitserve.bench.metrics import SLO, meets_slo, percentile, summarize, tpot


def ok(ttft: float, e2el: float, out: int, prompt: int | None, itls=()) -> RequestResult:
    return RequestResult(
        True, ttft=ttft, e2el=e2el, output_tokens=out, prompt_tokens=prompt, itls=tuple(itls)
    )


# Times are binary fractions so that the SLO bounds are hit exactly.
# A: TPOT 125 ms, good. B: TTFT 250 ms misses 200. C: TPOT 300 ms misses 125.
# D: one token, no TPOT, good. E: failed.
RESULTS = [
    ok(0.125, 0.5, 4, 100, [0.04, 0.06]),
    ok(0.25, 0.75, 5, 50),
    ok(0.1, 1.6, 6, None, [0.1]),
    ok(0.15, 0.15, 1, 10),
    RequestResult(False, e2el=0.01, prompt_tokens=999, error="HTTP 500: boom"),
]
SLOS = SLO(ttft_ms=200.0, tpot_ms=125.0)


def test_percentile_interpolates_linearly_between_ranks() -> None:
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    assert percentile([7.0], 99) == 7.0
    assert percentile([1, 2, 3], 0) == 1 and percentile([1, 2, 3], 100) == 3


def test_percentile_of_empty_list_is_an_error() -> None:
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_excludes_the_first_token() -> None:
    assert tpot(ok(0.1, 1.0, 10, None)) == pytest.approx(0.1)
    assert tpot(ok(0.1, 0.1, 1, None)) is None
    assert tpot(RESULTS[4]) is None


def test_slo_checks_ttft_and_tpot_with_inclusive_bounds() -> None:
    assert [meets_slo(r, SLOS) for r in RESULTS] == [True, False, False, True, False]
    assert meets_slo(RESULTS[1], SLO(tpot_ms=125.0))
    assert meets_slo(RESULTS[2], SLO(ttft_ms=100.0))
    assert not meets_slo(RESULTS[0], SLO(ttft_ms=124.0))


def test_summary_counts_failed_request_and_excludes_it_from_totals() -> None:
    s = summarize(RESULTS, duration=2.0, slo=SLOS)
    assert (s["completed"], s["failed"]) == (4, 1)
    assert s["total_input_tokens"] == 160
    assert s["total_output_tokens"] == 16
    assert s["errors"] == {"HTTP 500: boom": 1}


def test_summary_throughputs_and_goodput_over_duration() -> None:
    s = summarize(RESULTS, duration=2.0, slo=SLOS)
    assert s["duration"] == 2.0
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(88.0)
    assert s["goodput"] == pytest.approx(1.0)
    assert summarize(RESULTS, 2.0, SLO())["goodput"] is None


def test_summary_latency_statistics_in_ms() -> None:
    s = summarize(RESULTS, duration=2.0, slo=SLOS, percentiles=(99,))
    assert s["mean_ttft_ms"] == pytest.approx(156.25)
    assert s["median_ttft_ms"] == pytest.approx(137.5)
    assert s["p99_ttft_ms"] == pytest.approx(247.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt(3242.1875))
    assert s["mean_tpot_ms"] == pytest.approx(550.0 / 3)
    assert s["median_tpot_ms"] == pytest.approx(125.0)
    assert s["p99_tpot_ms"] == pytest.approx(296.5)
    assert s["mean_itl_ms"] == pytest.approx(200.0 / 3)
    assert s["median_itl_ms"] == pytest.approx(60.0)
    assert s["p99_itl_ms"] == pytest.approx(99.2)
    assert s["mean_e2el_ms"] == pytest.approx(750.0)
    assert s["median_e2el_ms"] == pytest.approx(625.0)
    assert s["p99_e2el_ms"] == pytest.approx(1574.5)


def test_summary_of_all_failed_run_has_no_latencies() -> None:
    s = summarize([RESULTS[4]], duration=1.0, slo=SLOS)
    assert (s["completed"], s["failed"], s["request_throughput"]) == (0, 1, 0.0)
    assert s["mean_ttft_ms"] is None and s["p99_e2el_ms"] is None
    assert s["goodput"] == 0.0


def test_poisson_send_times_are_seeded_with_mean_gap_one_over_rate() -> None:
    times = send_times(2000, rate=4.0, seed=1)
    assert times[0] == 0.0 and times == send_times(2000, rate=4.0, seed=1)
    assert times != send_times(2000, rate=4.0, seed=2)
    assert times[-1] / 1999 == pytest.approx(0.25, rel=0.1)
    assert send_times(3, rate=math.inf, seed=0) == [0.0, 0.0, 0.0]
