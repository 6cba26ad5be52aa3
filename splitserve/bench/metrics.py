"""Benchmark metrics from per-request results: pure functions, vLLM's key names.

- TTFT: time from sending a request to its first token.
- TPOT: (e2el - ttft) / (output_tokens - 1), per request with at least two output tokens.
- ITL: every gap between two consecutive token events, across all requests.
- E2EL: time from sending a request to its last byte.
- Throughputs divide totals over completed requests by the benchmark duration.
- Goodput: completed requests per second that meet every SLO given (null without SLOs).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from splitserve.bench.client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2el")


@dataclass(frozen=True)
class SLO:
    """Service-level objectives in milliseconds; None means no objective on that metric."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between closest ranks."""
    if not values:
        raise ValueError("percentile of an empty list")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values)


def std(values: Sequence[float]) -> float:
    """Population standard deviation."""
    m = mean(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / len(values))


def tpot(result: RequestResult) -> float | None:
    """Time per output token after the first, in seconds; None below two output tokens."""
    if not result.success or result.output_tokens < 2:
        return None
    return (result.e2el - result.ttft) / (result.output_tokens - 1)


def meets_slo(result: RequestResult, slo: SLO) -> bool:
    """A completed request meets the SLO when its TTFT and TPOT are both within it.

    A request with a single output token has no TPOT, so only its TTFT is checked.
    """
    if not result.success:
        return False
    if slo.ttft_ms is not None and result.ttft * 1000.0 > slo.ttft_ms:
        return False
    per_token = tpot(result)
    return slo.tpot_ms is None or per_token is None or per_token * 1000.0 <= slo.tpot_ms


def latencies_ms(results: Sequence[RequestResult]) -> dict[str, list[float]]:
    """Each latency metric's samples in milliseconds, over completed requests."""
    done = [r for r in results if r.success]
    tpots = [t for t in (tpot(r) for r in done) if t is not None]
    return {
        "ttft": [r.ttft * 1000.0 for r in done],
        "tpot": [t * 1000.0 for t in tpots],
        "itl": [gap * 1000.0 for r in done for gap in r.itls],
        "e2el": [r.e2el * 1000.0 for r in done],
    }


def latency_stats(
    name: str, values_ms: Sequence[float], percentiles: Sequence[float]
) -> dict[str, float | None]:
    """``mean_<name>_ms``, ``median_``, ``std_`` and ``p<q>_``; None when there are no samples."""
    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"]
    keys += [f"p{q:g}_{name}_ms" for q in percentiles]
    if not values_ms:
        return dict.fromkeys(keys, None)
    stats = [mean(values_ms), percentile(values_ms, 50), std(values_ms)]
    stats += [percentile(values_ms, q) for q in percentiles]
    return dict(zip(keys, stats, strict=True))


def throughput_stats(results: Sequence[RequestResult], duration: float, slo: SLO) -> dict[str, Any]:
    """Counts, token totals and per-second rates over the benchmark duration."""
    done = [r for r in results if r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    good = sum(meets_slo(r, slo) for r in done)
    return {
        "duration": duration,
        "completed": len(done),
        "failed": len(results) - len(done),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "goodput": good / duration if slo.given else None,
    }


def error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    """How many requests failed with each error message, most frequent first."""
    return dict(Counter(r.error for r in results if not r.success).most_common())


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    slo: SLO,
    percentiles: Sequence[float] = (99,),
) -> dict[str, Any]:
    """All metrics of one run, flat, with vLLM's key names where vLLM has them."""
    if duration <= 0:
        raise ValueError("duration must be positive")
    summary = throughput_stats(results, duration, slo)
    for name, values in latencies_ms(results).items():
        summary.update(latency_stats(name, values, percentiles))
    summary["errors"] = error_counts(results)
    return summary
