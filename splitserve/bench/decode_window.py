"""Steady-state decode accounting for the offline benchmark.

With chunked prefill, the first requests of a batch decode while later ones still prefill, and
the first to start finish while others still decode. Neither phase runs the batch the result is
reported for, so neither counts: the window opens at the end of the first step after which
every request has its first token, and closes with the first step in which a request finishes
(that step still decoded every request). Inside it every step decodes the whole batch, so the
tokens counted are exactly batch x steps. Steps that returned no tokens (the launch of an
overlapped decode step, whose tokens arrive with the next call) add no step; a step that returned
tokens for only part of the batch (a preemption) closes the window before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StepTokens:
    """One engine step as the benchmark saw it: when it returned, and for each request that got
    a token in it, how many tokens that request has now."""

    at: float
    lengths: dict[str, int]
    finished: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class DecodeWindow:
    steps: int
    tokens: int
    seconds: float
    tokens_before: int
    """Decode tokens (first tokens excluded) produced before the window opened: not counted."""
    mean_generated: float
    """Tokens a request had already generated at a window step, averaged over requests and
    steps: its KV context is the prompt plus these."""


def steady_window(steps: list[StepTokens], batch: int) -> DecodeWindow:
    """The window of ``steps`` (in order) in which all ``batch`` requests were decoding.

    ValueError when there is none: the first request finished before the last one started.
    """
    lengths: dict[str, int] = {}
    opened: StepTokens | None = None
    at_open: dict[str, int] = {}
    counted, closed_at = 0, 0.0
    for step in steps:
        if opened is None:
            lengths.update(step.lengths)
            if step.finished:
                break
            if len(lengths) == batch:
                opened, at_open, closed_at = step, dict(lengths), step.at
            continue
        if not step.lengths:
            continue
        if len(step.lengths) != batch:
            break
        counted, closed_at = counted + 1, step.at
        if step.finished:
            break
    if opened is None or counted == 0:
        raise ValueError(
            "no step decoded the whole batch: the first request finished before the last "
            "one started (raise the output length or the prefill token budget)"
        )
    before = sum(at_open.values())
    return DecodeWindow(
        steps=counted,
        tokens=batch * counted,
        seconds=max(closed_at - opened.at, 1e-9),
        tokens_before=before - batch,
        mean_generated=before / batch + (counted - 1) / 2,
    )
