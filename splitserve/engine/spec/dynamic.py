"""Dynamic verification: how many draft tokens each request verifies in a step.

Two things are measured as the engine runs: each request's acceptance rate (the chance that
its next draft token is accepted, given the one before was; counts that decay, so that a
request whose drafts stopped being accepted is retried later) and the step time as a linear
function of the step's tokens (``StepCost``). With per-token acceptance a, the j-th draft of a
request is worth a**j expected tokens; drafts are added best first while the step's expected
tokens per second rise. A batch whose step time grows with every token (compute-bound, large
batches) stops paying for drafts and verifies none: it then runs exactly as without
speculation.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9
MISS_WEIGHT = 4.0


class Acceptance:
    """One request's per-token acceptance rate from decayed counts of accepted and rejected
    drafts, started at a prior that it returns to while the request does not speculate."""

    def __init__(self) -> None:
        self.accepted = 0.0
        self.rejected = 0.0

    @property
    def rate(self) -> float:
        total = self.accepted + self.rejected + PRIOR_WEIGHT
        return (self.accepted + PRIOR_ACCEPTANCE * PRIOR_WEIGHT) / total

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.accepted = self.accepted * DECAY + num_accepted
        self.rejected = self.rejected * DECAY + (num_accepted < num_drafts)

    def missed(self) -> None:
        """Drafts were asked for and the drafter had none (no n-gram match): the step gave up
        its overlap for nothing. It counts as MISS_WEIGHT rejected drafts, so that a request
        whose lookups keep failing is asked again only after ``idle`` has decayed that (about
        a dozen steps later), not every few steps."""
        self.accepted *= DECAY
        self.rejected = self.rejected * DECAY + MISS_WEIGHT

    def idle(self) -> None:
        self.accepted *= DECAY
        self.rejected *= DECAY


class StepCost:
    """seconds ~ base + per_token * tokens + per_pass * draft passes, fitted by exponentially
    weighted least squares. A draft pass is one drafting round of the drafter (a draft model's
    forward pass; for the n-gram lookup, the extra work of a step that verifies anything).
    A few prior points (tokens costing 1/64 of a step's fixed part, a pass 5% of it) keep the
    fit defined before the data vary; they are scaled to the measured steps' mean time.
    ``explore`` asks for a step without drafts when the fit has seen too few of them: all
    speculative steps alone cannot tell the fixed part from the passes."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.gram = np.zeros((3, 3))
        self.moments = np.zeros(3)
        self.plain_weight = 0.0

    def record(self, tokens: int, passes: int, seconds: float) -> None:
        x = np.array([1.0, tokens, passes])
        self.gram = self.gram * self.decay + np.outer(x, x)
        self.moments = self.moments * self.decay + x * seconds
        self.plain_weight = self.plain_weight * self.decay + (passes == 0)

    @property
    def explore(self) -> bool:
        total = self.gram[0, 0]
        return total > 4 and self.plain_weight < 0.05 * total

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_token, per_pass) seconds."""
        scale = self.moments[0] / self.gram[0, 0] if self.gram[0, 0] else 1e-3
        gram, moments = self.gram.copy(), self.moments.copy()
        for tokens, passes, ratio in ((1, 0, 1.0), (64, 0, 2.0), (1, 1, 1.05)):
            x = np.array([1.0, tokens, passes])
            gram += 0.1 * np.outer(x, x)
            moments += 0.1 * x * ratio * scale
        base, per_token, per_pass = np.linalg.solve(gram, moments)
        return max(base, 1e-9), max(per_token, 0.0), max(per_pass, 0.0)


def plan_drafts(
    rates: list[float],
    max_k: int,
    cost: StepCost,
    passes: Callable[[list[int]], int],
    max_rows: int | None = None,
) -> list[int]:
    """Draft tokens per request: the count of best drafts (worth rate**j) that maximizes
    expected tokens per second of the step, shared out to the requests they belong to.
    passes: the drafter's passes for a list of draft counts. max_rows: the most rows a step
    keeps on the path the fit has measured (the CPU's native decode path; None: no bound),
    where the cost is not linear past it."""
    if cost.explore:
        return [0] * len(rates)
    base, per_token, per_pass = cost.coefficients()
    gains = sorted(
        ((rate**j, row) for row, rate in enumerate(rates) for j in range(1, max_k + 1)),
        reverse=True,
    )
    batch = len(rates)
    limits = [0] * batch
    best, best_rate, expected = 0, batch / (base + per_token * batch), float(batch)
    if max_rows is not None:
        gains = gains[: max(0, max_rows - batch)]
    for count, (gain, row) in enumerate(gains, start=1):
        expected += gain
        limits[row] += 1
        seconds = base + per_token * (batch + count) + per_pass * passes(limits)
        if expected / seconds > best_rate:
            best, best_rate = count, expected / seconds
    limits = [0] * batch
    for _, row in gains[:best]:
        limits[row] += 1
    return limits
