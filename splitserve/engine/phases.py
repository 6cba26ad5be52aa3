"""Where a loop's time goes: seconds summed per named phase since start.

The engine times the parts of its step (schedule, forward, wait, outputs) and a worker the
parts of its loop round around it (receive, adopt, send, stats, idle); both report the totals
(WorkerStats.loop_phases), and a benchmark turns two readings into milliseconds per step.
One ``perf_counter`` call per phase boundary: cheap enough to stay on in production.
"""

from __future__ import annotations

import time


class PhaseTimer:
    """``lap(phase)`` charges the time since the previous lap (or ``start``) to ``phase``."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._last = time.perf_counter()

    def start(self) -> None:
        """Begin timing from now (time before it is charged to nothing)."""
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] = self.seconds.get(phase, 0.0) + (now - self._last)
        self._last = now
