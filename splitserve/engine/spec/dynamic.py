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

import numpy as np

PRIOR_ACCEPTANCE = 0.6
PRIOR_WEIGHT = 2.0
DECAY = 0.9


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

    def idle(self) -> None:
        self.accepted *= DECAY
        self.rejected *= DECAY


class StepCost:
    """seconds ~ base + per_token * tokens + spec (once, in a step that verifies drafts),
    fitted by exponentially weighted least squares. A few prior points (a step whose tokens
    cost 1/64 of its fixed part, a verify step 5% more) keep the fit defined before the data
    vary; they are scaled to the measured steps' mean time."""

    FEATURES = 3

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self.gram = np.zeros((self.FEATURES, self.FEATURES))
        self.moments = np.zeros(self.FEATURES)
        self.num_steps = 0

    def record(self, tokens: int, speculated: bool, seconds: float) -> None:
        x = np.array([1.0, tokens, float(speculated)])
        self.gram = self.gram * self.decay + np.outer(x, x)
        self.moments = self.moments * self.decay + x * seconds
        self.num_steps += 1

    def coefficients(self) -> tuple[float, float, float]:
        """(base, per_token, spec) seconds; priors scaled to the measured steps."""
        scale = self.moments[0] / self.gram[0, 0] if self.gram[0, 0] else 1e-3
        gram, moments = self.gram.copy(), self.moments.copy()
        for tokens, spec, ratio in ((1, 0, 1.0), (64, 0, 2.0), (1, 1, 1.05)):
            x = np.array([1.0, tokens, spec])
            gram += 0.1 * np.outer(x, x)
            moments += 0.1 * x * ratio * scale
        base, per_token, spec = np.linalg.solve(gram, moments)
        return max(base, 1e-9), max(per_token, 0.0), max(spec, 0.0)


def plan_drafts(rates: list[float], max_k: int, cost: StepCost) -> list[int]:
    """Draft tokens per request: the count of best drafts (worth rate**j) that maximizes
    expected tokens per second of the step, shared out to the requests they belong to."""
    base, per_token, spec = cost.coefficients()
    gains = sorted(
        ((rate**j, row) for row, rate in enumerate(rates) for j in range(1, max_k + 1)),
        reverse=True,
    )
    batch = len(rates)
    best, best_rate, expected = 0, batch / (base + per_token * batch), float(batch)
    for count, (gain, _) in enumerate(gains, start=1):
        expected += gain
        rate = expected / (base + per_token * (batch + count) + spec)
        if rate > best_rate:
            best, best_rate = count, rate
    limits = [0] * batch
    for _, row in gains[:best]:
        limits[row] += 1
    return limits
