"""Dynamic verification: how many drafted tokens each request verifies in a step.

Two things are measured as the engine runs. Each request's acceptance (``Acceptance``): a
posterior over its per-token acceptance rate a that forgets a little every step, so that a
request that stops quoting its prompt (a rejection at the first draft, where a was near 1)
drops within a step or two, and one that starts again is retried. And the step time per
number of rows a step runs (``StepCurve``): a table timed at start-up on the device itself
(engine/warm_up.py), corrected online from every real step. The j-th draft of a request is
worth E[a**j] expected tokens; ``plan_drafts`` adds drafts best first and keeps the count
that maximizes expected tokens per second of the step, plain decoding (no drafts) included.
On a curve that is flat at small row counts (memory-bound) that is the best fixed k or more;
where every row costs (compute-bound, or acceptance near zero) it is no drafts at all.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np

ACCEPTANCE_GRID = (0.02, 0.2, 0.4, 0.6, 0.75, 0.85, 0.92, 0.97, 0.995)
"""The per-token acceptance rates a request's posterior is kept over (uniform prior)."""
FORGET = 0.1
"""Each step the posterior moves this much of the way back to the prior: a request can change
behaviour at any step (quoted text, then free text)."""
_GRID = np.array(ACCEPTANCE_GRID)
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


class Acceptance:
    """One request's per-token acceptance rate as a posterior over ``ACCEPTANCE_GRID``. A step
    that verified d drafts and accepted m of them has likelihood a**m * (1 - a if m < d)."""

    def __init__(self) -> None:
        self.weights = np.full(len(ACCEPTANCE_GRID), 1.0 / len(ACCEPTANCE_GRID))

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

    def record(self, num_drafts: int, num_accepted: int) -> None:
        posterior = self.weights * _GRID**num_accepted
        if num_accepted < num_drafts:
            posterior *= 1 - _GRID
        self.weights = posterior / posterior.sum()
        self.idle()

    def idle(self) -> None:
        """A step passed: forget a little, toward the prior."""
        self.weights = (1 - FORGET) * self.weights + FORGET / len(ACCEPTANCE_GRID)


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
