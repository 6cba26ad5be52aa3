"""Dynamic verification: how many drafted tokens each request verifies in a step.

Two things are measured as the engine runs. Each request's acceptance (``Acceptance``): a
posterior over its per-token acceptance rate a, from the request's verifications, each
weighing less every step (``Evidence``), so that one that starts quoting its prompt again is
retried; its prior is what the engine's recent verifications of all requests showed, worth a
few verifications at most; and after a verification that kept no draft (a request that stops
quoting rejects its first draft while its posterior is still sure of a near 1) it verifies
one draft at most until one is kept (after ``PROBE_AFTER`` such, only on probe steps: below).
And the step time per number of rows a step runs (``StepCurve``): a table timed at start-up
on the device itself (engine/warm_up.py), corrected online from every real step. The j-th
draft of a request is worth E[a**j] expected tokens; ``plan_drafts`` adds drafts best first
and keeps the count that maximizes expected tokens per second of the step, plain decoding (no
drafts) included. On a curve that is flat at small row counts (memory-bound) that is the best
fixed k or more; where every row costs (compute-bound, or acceptance near zero) it is no
drafts at all.

A posterior learns only from drafts that are verified: planned from its mean alone, a request
whose drafts look no better than the prior is never verified, and never shows otherwise (at
batch 8 on the AMD EPYC VM's CPU, where a row costs three quarters of a token, a request that
copied its prompt verified no draft: issue 49). So a request's first draft is worth its mean
acceptance plus one standard deviation (``PROBE_SPREAD``): optimism that costs at most one row
per request and step, shrinks as evidence gathers, and is taken only where such a draft would
pay for its row.

Where plain steps run overlapped (a GPU: CUDA graphs, the host's work hidden), they are priced
by a curve of their own, which only two overlapped steps in a row time. It starts from the
start-up table of eager steps, far above them, and a planner that believes it verifies every
step and so never times two plain steps in a row (on an H200, a draft model whose drafts were
never accepted drafted every step: 0.72x of plain). So a plain step is priced at most what the
cheapest synchronous step of more rows was measured to cost (``StepCurve.least_measured``),
and exploration is budgeted (engine/spec/speculator.py): a request whose last ``PROBE_AFTER``
verifications kept nothing verifies only on probe steps, which give one draft, worth a token
(what it is if drafts are right again), to each request that the plan leaves without. A probe
step is due once two plain steps in a row have timed the overlapped curve, and once the
steps since the last probe pay for its cost over a plain step at ``PROBE_BUDGET`` of their
time (an H200 with the two-layer draft: every forty steps or so; where a row costs nothing,
every step). Evidence fades on overlapped steps too: a request whose probe is kept is planned
from its posterior again within a few steps.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import numpy as np

ACCEPTANCE_GRID = (0.02, 0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.97, 0.995)
"""The per-token acceptance rates a posterior is kept over (uniform before any evidence)."""
FORGET = 0.1
"""Each step, evidence weighs this much less: a request can change behaviour at any step
(quoted text, then free text)."""
POOL_WEIGHT = 4.0
"""The most verifications' worth of evidence that the engine's pool lends a request's prior."""
PROBE_SPREAD = 1.0
"""A request's first draft is worth its mean acceptance plus this many standard deviations."""
PROBE_AFTER = 2
"""A request whose last this many verifications kept no draft verifies only on probe steps."""
PROBE_BUDGET = 0.01
"""Probe steps cost at most this share of plain decoding's time."""
_GRID = np.array(ACCEPTANCE_GRID)
_LOG_ACCEPTED = np.log(_GRID)
_LOG_REJECTED = np.log1p(-_GRID)
_POWERS = _GRID[None, :] ** np.arange(1, 17)[:, None]
"""a**j for j = 1..16 (rows) and every a of the grid (columns)."""
CURVE_RATE_DOWN = 0.4
CURVE_RATE_UP = 0.1
"""How far a row count's estimate moves toward a step that ran faster or slower than it: other
work on the machine only slows steps, so the estimate follows the faster ones more."""
CURVE_OFFSET_SHARE = 0.25
"""The part of that move that every row count takes (the offset)."""
CURVE_FORGET = 0.02
"""Each step, every row count's own correction moves this much back toward zero: a count that
steps stalled by other work priced out of use comes back to the table and is tried again."""


class Evidence:
    """Verifications as a log-likelihood over ``ACCEPTANCE_GRID``: one that verified d drafts
    and accepted m has likelihood a**m * (1 - a if m < d). ``fade`` (each step) weighs all of
    it, and its count of verifications, ``FORGET`` less."""

    def __init__(self) -> None:
        self.log = np.zeros(len(ACCEPTANCE_GRID))
        self.count = 0.0

    def add(self, num_drafts: int, num_accepted: int) -> None:
        self.log += num_accepted * _LOG_ACCEPTED
        if num_accepted < num_drafts:
            self.log += _LOG_REJECTED
        self.count += 1.0

    def fade(self) -> None:
        self.log *= 1 - FORGET
        self.count *= 1 - FORGET


class Acceptance:
    """One request's per-token acceptance rate: a posterior over ``ACCEPTANCE_GRID`` from its
    own evidence and a prior from the engine's pool (every request's evidence, tempered to at
    most ``POOL_WEIGHT`` verifications), which the request adds to as it verifies."""

    def __init__(self, pool: Evidence | None = None) -> None:
        self.own = Evidence()
        self.pool = pool
        self.misses = 0
        """Verifications in a row that accepted no draft: after one, the next verifies one
        draft at most; after ``PROBE_AFTER``, only on probe steps."""

    @property
    def weights(self) -> np.ndarray:
        log = self.own.log
        if self.pool is not None and self.pool.count:
            log = log + self.pool.log * min(1.0, POOL_WEIGHT / self.pool.count)
        weights = np.exp(log - log.max())
        normalized: np.ndarray = weights / weights.sum()
        return normalized

    @property
    def rate(self) -> float:
        return self.value(1)

    def value(self, j: int) -> float:
        """Expected acceptance of the j-th draft (1-based): E[a**j]."""
        return float(_POWERS[j - 1] @ self.weights)

    def values(self, k: int) -> list[float]:
        """E[a**j] for j = 1..k (k <= 16, the most drafts a config allows)."""
        values: list[float] = (_POWERS[:k] @ self.weights).tolist()
        return values

    def offer(self, k: int) -> list[float]:
        """What each of the request's next k drafts is worth to the plan: E[a**j], the first
        raised by ``PROBE_SPREAD`` standard deviations of a (at most a token); only the first
        after a verification that accepted none (a request that stopped quoting its prompt
        rejects its first draft before its posterior, sure of a near 1, has moved)."""
        if k == 0:
            return []
        values = self.values(max(k, 2))
        spread = max(values[1] - values[0] ** 2, 0.0) ** 0.5
        first = [min(values[0] + PROBE_SPREAD * spread, 1.0)]
        return first if self.misses else first + values[1:k]

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.own.add(num_drafts, num_accepted)
        self.misses = self.misses + 1 if num_accepted == 0 else 0
        if self.pool is not None:
            self.pool.add(num_drafts, num_accepted)
        self.idle()

    def idle(self) -> None:
        """A step passed: the request's evidence weighs a little less."""
        self.own.fade()


class StepCurve:
    """Seconds of a step by its number of rows: a table measured on the device (made
    non-decreasing in rows, interpolated between its points, extended along its last slope),
    plus what real steps taught it: an offset shared by every row count (host work the table
    does not time, a busier machine) and a correction per row count seen, which fades unless
    steps of that count renew it. An error is clipped to the estimate's size, and slower
    steps move the estimate less than faster ones, so that steps stalled by other work do not
    price a row count out of use."""

    def __init__(self, measured: dict[int, float]) -> None:
        if not measured:
            raise ValueError("a step curve needs at least one measured row count")
        self.rows = sorted(measured)
        self.table = [measured[r] for r in self.rows]
        for i in range(len(self.table) - 2, -1, -1):  # fewer rows never cost more: a point
            self.table[i] = min(self.table[i], self.table[i + 1])  # stalled while timed
        self.offset = 0.0
        self.correction: dict[int, float] = {}

    def seconds(self, rows: int) -> float:
        return max(self._table(rows) + self.offset + self.correction.get(rows, 0.0), 1e-9)

    def least_measured(self, rows: int) -> float:
        """The least estimate of a step of more than ``rows`` rows that real steps timed
        (infinity where none did)."""
        return min((self.seconds(r) for r in self.correction if r > rows), default=math.inf)

    def record(self, rows: int, seconds: float) -> None:
        estimate = self.seconds(rows)
        error = min(max(seconds - estimate, -0.5 * estimate), estimate)
        rate = CURVE_RATE_DOWN if error < 0 else CURVE_RATE_UP
        self.offset += CURVE_OFFSET_SHARE * rate * error
        own = self.correction.get(rows, 0.0) + rate * error
        self.correction = {r: c * (1 - CURVE_FORGET) for r, c in self.correction.items()}
        self.correction[rows] = own

    def _table(self, rows: int) -> float:
        i = bisect.bisect_left(self.rows, rows)
        if i < len(self.rows) and self.rows[i] == rows:
            return self.table[i]
        if len(self.rows) == 1 or i == 0:
            return self.table[0]
        i = min(i, len(self.rows) - 1)  # past the last point: the last segment's slope
        r0, r1, t0, t1 = self.rows[i - 1], self.rows[i], self.table[i - 1], self.table[i]
        return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)


def plan_drafts(
    values: list[list[float]],
    step_seconds: Callable[[int, int], float],
    max_rows: int | None = None,
) -> list[int]:
    """Drafts each request verifies: values[i][j - 1] is what request i's j-th draft is worth
    in expected tokens (non-increasing in j; the list's length is the most it may verify).
    step_seconds(drafts, longest): the step's seconds with that many drafts in all, the most
    of one request being ``longest`` (0, 0: plain decoding). Drafts are taken best first; the
    count kept maximizes expected tokens per second. max_rows: a step keeps at most this many
    rows (the batch plus its drafts)."""
    batch = len(values)
    gains = sorted(
        ((value, row) for row, row_values in enumerate(values) for value in row_values),
        key=lambda gain: -gain[0],
    )
    if max_rows is not None:
        gains = gains[: max(0, max_rows - batch)]
    limits = [0] * batch
    expected, longest = float(batch), 0
    best, best_rate = 0, expected / step_seconds(0, 0)
    for count, (value, row) in enumerate(gains, start=1):
        expected += value
        limits[row] += 1
        longest = max(longest, limits[row])
        rate = expected / step_seconds(count, longest)
        if rate > best_rate:
            best, best_rate = count, rate
    limits = [0] * batch
    for _, row in gains[:best]:
        limits[row] += 1
    return limits
