"""Dynamic verification where plain steps overlap (a GPU): the speculator driven as
``LLMEngine.step`` drives it, on a clock that a model of an H200 decoding the Llama-3-8B shape
advances (issue 49's H200 table: a draft model of the target's first two layers, whose drafts
are never accepted, drafted every step there and ran at 0.72x of plain decoding)."""

from __future__ import annotations

from typing import cast

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.spec import speculator as module
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.spec.drafter import Drafter

PLAIN = 0.004
"""An overlapped plain step (CUDA graphs, the host's work hidden), whatever the batch."""
DRAFT_PASS = 0.0007
"""A pass of the two-layer draft model."""
LOOKUP = 0.00002
"""An n-gram lookup."""
EAGER = {rows: 0.007 + 0.00002 * rows for rows in range(1, 73)}
"""The start-up table (engine/warm_up.py times eager steps: far above the graphs' steps)."""
RIGHT, WRONG = 0, 1
"""The target's token at every position (every row's argmax), and a draft it never takes."""


def _verify_seconds(rows: int) -> float:
    """A synchronous verify step: memory-bound, so a row more costs next to nothing, but the
    host's work is no longer hidden."""
    return 0.0048 + 0.00002 * rows


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _DraftModel(Drafter):
    """Drafts the target's tokens or wrong ones (``right``); a pass per draft token."""

    pass_seconds = DRAFT_PASS

    def __init__(self, clock: _Clock) -> None:
        self.clock = clock
        self.right = False

    def propose(self, reqs: list[Request], limits: list[int]) -> list[list[int]]:
        self.clock.now += self.pass_seconds * self.passes(limits)
        return [[RIGHT if self.right else WRONG] * k for k in limits]

    def passes(self, limits: list[int]) -> int:
        return max(limits, default=0)

    def release(self, req: Request) -> None:
        pass


class _Lookup(_DraftModel):
    """An n-gram lookup that finds a draft every step: one pass, whatever the count."""

    pass_seconds = LOOKUP

    def passes(self, limits: list[int]) -> int:
        return int(any(limits))


class _Blocks:
    def commit(self, req: Request) -> None:
        pass

    def trim(self, req: Request, num_tokens: int) -> None:
        pass


def _decode(
    monkeypatch: pytest.MonkeyPatch, lookup: bool, batch: int, steps: int, right_from: int
) -> tuple[float, list[int]]:
    """Decode ``steps`` steps of ``batch`` requests, drafts right from step ``right_from``:
    tokens per second over plain decoding's, and the drafts verified at each step."""
    clock = _Clock()
    monkeypatch.setattr(module.time, "perf_counter", clock)
    drafter = (_Lookup if lookup else _DraftModel)(clock)
    config = SpeculativeConfig("ngram", 8) if lookup else SpeculativeConfig("draft_model", 8, "d")
    spec = module.Speculator(config, drafter, 4096)
    spec.measure(EAGER, overlapping=True)
    reqs = [Request(f"r{i}", list(range(20)), SamplingParams(temperature=0)) for i in range(batch)]
    for req in reqs:
        req.num_computed_tokens = req.num_tokens - 1  # nothing is appended: always decoding
    inflight, tokens, verified = False, 0, []
    for step in range(steps):
        drafter.right = step >= right_from
        if inflight and any(spec.limits(reqs)):
            inflight = False  # the step in flight is read; its device time ran from its launch
        if not inflight:
            spec.propose(reqs)
        verified.append(sum(len(r.draft_token_ids) for r in reqs))
        if not verified[-1]:
            spec.overlapped(reqs)
            clock.now += PLAIN
            inflight, tokens = True, tokens + batch
            continue
        scheduled = ScheduledBatch()
        for req in reqs:
            scheduled.add(req, 1 + len(req.draft_token_ids))
        rows = sum(scheduled.num_new_tokens)
        clock.now += _verify_seconds(rows)
        logits = torch.zeros(rows, 2)
        logits[:, RIGHT] = 1.0
        blocks = cast(BlockManager, _Blocks())
        tokens += sum(
            1 for _ in spec.verify(scheduled, list(range(batch)), logits, Sampler(0), blocks)
        )
    return tokens / clock.now / (batch / PLAIN), verified


@pytest.mark.parametrize("lookup", [False, True], ids=["draft_model", "lookup"])
@pytest.mark.parametrize("batch", [1, 8])
def test_drafts_never_accepted_stop_within_a_few_steps_and_decode_at_plain_speed(
    monkeypatch: pytest.MonkeyPatch, lookup: bool, batch: int
) -> None:
    """The start-up table prices the plain step at 7 ms, the overlapped step takes 4 and a
    one-draft verify 4.8 plus the draft pass: the planner that believed the table verified a
    draft every step (0.72x of plain with the draft model, 0.82x with the lookup)."""
    speed, verified = _decode(monkeypatch, lookup, batch, 400, right_from=400)
    assert speed >= 0.98
    assert not any(verified[8:30])
    assert all(any(verified[step : step + 60]) for step in range(30, 340))  # probes go on


@pytest.mark.parametrize("batch", [1, 8])
def test_drafts_that_start_being_right_are_found_at_the_next_probe(
    monkeypatch: pytest.MonkeyPatch, batch: int
) -> None:
    """A probe every forty steps or so (each costs 0.4 of a plain step: 1% of the time), then
    one draft until the posterior catches up, a few steps."""
    for right_from in (200, 220):
        _, verified = _decode(monkeypatch, False, batch, 280, right_from)
        resumed = next(step for step in range(right_from, 280) if verified[step] >= 8 * batch)
        assert resumed - right_from <= 55
        assert min(verified[resumed:]) == 8 * batch
