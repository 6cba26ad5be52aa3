"""Speculative decoding in the engine: drafts before a step, verification after it.

Before a synchronous step, ``propose`` gives each decoding request a number of draft tokens
(engine/spec/dynamic.py) and asks the drafter for them; they sit in ``req.draft_token_ids``,
which the scheduler counts in the request's tokens and the model runner lays out after its
last token, returning logits at every one of those positions. ``verify`` then walks each
request's positions in order: it samples position j exactly as a step without speculation
would (the same sampler, grammar mask, penalties and logprobs, the request's state advanced
by the tokens kept so far), hands it to the engine, which appends it (stops, max_tokens and
the grammar see one token at a time), and goes on only while the token equals draft j.

That is rejection sampling for a point-mass draft distribution: draft d is kept with
probability p(d), and when it is not, the token drawn is distributed as p without d,
renormalized, which is the residual max(0, p - q) for q = one-hot(d). So greedy output is the
output without speculation, and sampled output has the target's distribution exactly (a
seeded request even draws the same tokens: one draw per token kept, as without drafts).

Rejected drafts' KV is rolled back: the request's computed tokens end before its newest
token, and its tail blocks past them go back to the pool (``BlockManager.trim``); a draft
model rolls its own KV back the same way when it next proposes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.model_runner import ModelRunner
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, SampleResult, greedy_tokens, plain_greedy
from splitserve.engine.scheduler import ScheduledBatch
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.spec.draft_model import DraftModelDrafter
from splitserve.engine.spec.drafter import Drafter
from splitserve.engine.spec.dynamic import (
    PROBE_AFTER,
    PROBE_BUDGET,
    Acceptance,
    Evidence,
    StepCurve,
    plan_drafts,
)
from splitserve.engine.spec.mtp import MTPDrafter
from splitserve.engine.spec.ngram import NgramDrafter


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: drafts (request-steps that verified drafts), draft
    tokens, accepted tokens, and accepted tokens by draft position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.accepted_per_pos[pos] += 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step of a request: accepted drafts plus the one sampled."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class Speculator:
    def __init__(self, config: SpeculativeConfig, drafter: Drafter, max_model_len: int) -> None:
        self.config = config
        self.drafter = drafter
        self.max_model_len = max_model_len
        self.max_rows: int | None = None
        """Verify steps stay below this many rows (dynamic mode; set by the engine from the
        CPU's native decode path, past which a step dequantizes its weights)."""
        self.counters = SpecCounters(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.curve = StepCurve({1: 0.01})
        """Synchronous steps' seconds by rows; the engine times the device's (``measure``)."""
        self.overlapped_curve: StepCurve | None = None
        """Overlapped plain steps' seconds by rows, where the engine overlaps them."""
        self.pass_seconds = 0.0
        """Measured seconds of one drafting pass (a draft model's forward, a lookup)."""
        self.acceptance: dict[str, Acceptance] = {}
        self.pool = Evidence()
        """Every request's verifications: the prior of a request's acceptance."""
        self._since_probe = 0
        """Steps since the last probe (engine/spec/dynamic.py)."""
        self._started = 0.0
        self._drafting = 0.0
        self._last_overlapped: float | None = None
        """When the last overlapped decode step was launched, while the steps since were all
        overlapped (None after a synchronous one)."""
        self._missed = False
        """The last ``propose`` asked for drafts and found none: the overlapped step that
        follows lost its overlap (the step in flight was read first)."""

    def measure(self, seconds_by_rows: dict[int, float], overlapping: bool) -> None:
        """The step time by rows timed on the device (engine/warm_up.py), and whether plain
        decode steps run overlapped (then they are priced by a curve of their own)."""
        self.curve = StepCurve(seconds_by_rows)
        self.overlapped_curve = StepCurve(seconds_by_rows) if overlapping else None

    def limits(self, reqs: list[Request]) -> list[int]:
        """The most draft tokens each request may verify in the next step."""
        return self._limits(reqs)[0]

    def _limits(self, reqs: list[Request]) -> tuple[list[int], bool]:
        """``limits``, and whether they probe."""
        k = self.config.num_speculative_tokens
        caps = [min(k, self._room(r)) for r in reqs]
        if not self.config.dynamic:
            return caps, False
        return self._plan(reqs, caps, drafting=True)

    def _plan(self, reqs: list[Request], caps: list[int], drafting: bool) -> tuple[list[int], bool]:
        """Dynamic plan for reqs verifying at most caps drafts, and whether it probes;
        drafting: the drafts are still to be made (their passes cost), else they are made
        and only their rows cost. A probe step gives one draft, worth a token (what it is if
        drafts are right again), to each request that the plan leaves without, where the
        steps since the last probe pay for it (``PROBE_BUDGET``)."""
        batch = len(reqs)
        if not any(caps):  # most steps of free text: no lookup found a draft
            return caps, False
        passes = self.drafter.passes
        plain = self._plain_seconds(batch)

        def step_seconds(drafts: int, longest: int) -> float:
            if drafts == 0:
                return plain
            drafting_seconds = self.pass_seconds * passes([longest]) if drafting else 0.0
            return self.curve.seconds(batch + drafts) + drafting_seconds

        rates = [self._acceptance(r) for r in reqs]
        values = [[] if r.misses >= PROBE_AFTER else r.offer(c) for r, c in zip(rates, caps)]
        limits = plan_drafts(values, step_seconds, self.max_rows)
        probes = [i for i, (cap, n) in enumerate(zip(caps, limits)) if cap and not n]
        if not probes or not self._probe_due(limits, len(probes), step_seconds):
            return limits, False
        for i in probes:
            values[i] = [1.0]
        limits = plan_drafts(values, step_seconds, self.max_rows)
        return limits, any(limits[i] for i in probes)

    def _probe_due(
        self, limits: list[int], probes: int, step_seconds: Callable[[int, int], float]
    ) -> bool:
        """Whether a step planned as limits may add a draft for each of ``probes`` requests:
        once a plain step was timed since the last probe (where they overlap, the launch of a
        second in a row times the first), and once the steps since pay for the probe's cost at
        ``PROBE_BUDGET`` of a plain step each."""
        if self.overlapped_curve is not None and self._since_probe <= 2:
            return False
        drafts, longest = sum(limits), max(limits)
        cost = step_seconds(drafts + probes, max(longest, 1)) - step_seconds(drafts, longest)
        return self._since_probe * PROBE_BUDGET * step_seconds(0, 0) >= cost

    def _plain_seconds(self, batch: int) -> float:
        """A step of the batch without drafts. Overlapped, it costs no more than any
        synchronous step of more rows: those are timed by every verification, while the
        overlapped curve learns only from two plain steps in a row."""
        if self.overlapped_curve is None:
            return self.curve.seconds(batch)
        return min(self.overlapped_curve.seconds(batch), self.curve.least_measured(batch))

    def overlapped(self, reqs: list[Request]) -> None:
        """An overlapped decode step of reqs (a row each) is launched. Steps without drafts take
        that path (CUDA graphs, host work hidden behind the device's) and never reach
        ``verify``; the time between two consecutive launches is one such step, recorded so
        that drafts are weighed against the plain step that really runs (on a GPU several
        times cheaper than a synchronous eager one). After a lookup that found nothing it is
        a step that lost its overlap, recorded as a synchronous one."""
        now = time.perf_counter()
        if self._last_overlapped is not None:
            curve = self.curve if self._missed else self.overlapped_curve
            if curve is not None:
                curve.record(len(reqs), now - self._last_overlapped)
        self._missed = False
        self._last_overlapped = now
        self._stepped(reqs)

    def idle(self) -> None:
        """The engine had nothing to run: the next overlapped launch starts a new run of
        them (the gap is not a step's time)."""
        self._last_overlapped = None

    def propose(self, running: list[Request]) -> None:
        """Draft tokens for the running requests that decode next; starts the step's clock.
        A drafter whose passes do not depend on the count (a lookup) is asked for every
        draft it may make (by every request, unless asking would cost an overlapped step);
        once the drafts are known, the plan is made over what they are (a request with fewer
        leaves rows to the others)."""
        self._started = time.perf_counter()
        for req in running:  # drafts of a request the last step had no budget for
            req.draft_token_ids = []
        reqs = [r for r in running if _decoding(r)]
        k = self.config.num_speculative_tokens
        probed = False
        if self.drafter.passes([1]) != self.drafter.passes([16]):
            limits, probed = self._limits(reqs)
        elif self.overlapped_curve is None:  # a lookup, no overlap to lose: everyone asked
            limits = [min(k, self._room(r)) for r in reqs]
        else:
            asking, probed = self._limits(reqs)
            limits = [min(k, self._room(r)) if n else 0 for r, n in zip(reqs, asking)]
        asked = [i for i, n in enumerate(limits) if n > 0]
        drafted = time.perf_counter()
        drafts = self.drafter.propose([reqs[i] for i in asked], [limits[i] for i in asked])
        self._drafting = time.perf_counter() - drafted
        passes = self.drafter.passes([limits[i] for i in asked])
        if passes:
            self.pass_seconds += 0.2 * (self._drafting / passes - self.pass_seconds)
        caps = [0] * len(reqs)
        for i, draft in zip(asked, drafts):
            caps[i] = len(draft)
        if self.config.dynamic:
            caps, verified = self._plan(reqs, caps, drafting=False)
            probed = probed or verified  # paid where asked: a draft pass, or a lost overlap
        found = False
        for i, draft in zip(asked, drafts):
            reqs[i].draft_token_ids = draft[: caps[i]]
            found = found or bool(caps[i])
            if not draft and self.overlapped_curve is not None:
                self._acceptance(reqs[i]).record(1, 0)  # asking cost the overlap: a miss
        self._missed = bool(asked) and not found
        if probed:
            self._since_probe = 0
        self.pool.fade()

    def verify(
        self,
        batch: ScheduledBatch,
        sampled: list[int],
        logits: torch.Tensor,
        sampler: Sampler,
        block_manager: BlockManager,
    ) -> Iterator[tuple[int, SampleResult, bool]]:
        """Position by position over the step's sampled requests still going, yields (index
        in ``sampled``, the token drawn, whether it equals the request's draft there). The
        engine appends each token (or hands a prefill_only request over) before the next is
        drawn: a request goes on while its token matched and it did not finish. Once all
        stopped, each request's rejected positions are rolled back and the step recorded."""
        self.drafter.observe(batch)
        reqs = [batch.requests[i] for i in sampled]
        drafts = [r.draft_token_ids for r in reqs]
        offsets = [0]
        for req in reqs:
            offsets.append(offsets[-1] + 1 + len(req.draft_token_ids))
        greedy = None
        if all(plain_greedy(r) and r.grammar is None for r in reqs):
            greedy = greedy_tokens(logits).tolist()  # one argmax for every position
        kept = [0] * len(reqs)
        going = list(range(len(reqs)))
        position = 0
        while going:
            rows = [offsets[i] + position for i in going]
            if greedy is not None:
                results = [SampleResult(greedy[row]) for row in rows]
            else:
                results = sampler(logits[rows], [reqs[i] for i in going])
            still = []
            for i, result in zip(going, results):
                draft = drafts[i]
                matched = position < len(draft) and result.token_id == draft[position]
                yield i, result, matched
                if matched and not reqs[i].prefill_only:
                    kept[i] += 1
                    if not reqs[i].is_finished:
                        still.append(i)
            going = still
            position += 1
        self._settle(batch, reqs, drafts, kept, block_manager)

    def _settle(
        self,
        batch: ScheduledBatch,
        reqs: list[Request],
        drafts: list[list[int]],
        kept: list[int],
        block_manager: BlockManager,
    ) -> None:
        """Roll back each request's rejected positions and record the verify step."""
        for req, draft, num_kept in zip(reqs, drafts, kept):
            req.draft_token_ids = []
            if draft:
                self._record(req, len(draft), num_kept)
            if not req.is_finished and not req.prefill_only:
                req.num_computed_tokens = req.num_tokens - 1
                block_manager.commit(req)
                block_manager.trim(req, req.num_computed_tokens)
        seconds = time.perf_counter() - self._started - self._drafting
        rows = sum(batch.num_new_tokens)
        if len(reqs) == len(batch.requests) and rows == len(reqs) + sum(map(len, drafts)):
            self.curve.record(rows, seconds)  # decode rows only: a prompt chunk is no verify
        self._drafting = 0.0
        self._last_overlapped = None
        self._stepped([r for r, draft in zip(reqs, drafts) if not draft])

    def _stepped(self, idle: list[Request]) -> None:
        """A step ran: the evidence of the requests that verified nothing in it weighs less
        (overlapped steps too: a request whose probe is kept is soon planned from its
        posterior again)."""
        for req in idle:
            if req.request_id in self.acceptance:
                self.acceptance[req.request_id].idle()
        self._since_probe += 1

    def release(self, req: Request) -> None:
        self.acceptance.pop(req.request_id, None)
        self.drafter.release(req)

    def _record(self, req: Request, num_drafts: int, num_kept: int) -> None:
        self.counters.record(num_drafts, num_kept)
        self._acceptance(req).record(num_drafts, num_kept)

    def _acceptance(self, req: Request) -> Acceptance:
        rate = self.acceptance.get(req.request_id)
        if rate is None:
            rate = self.acceptance[req.request_id] = Acceptance(self.pool)
        return rate

    def _room(self, req: Request) -> int:
        """Drafts that cannot overrun max_tokens or the context: one token always follows."""
        room = self.max_model_len - req.num_tokens - 1
        if req.params.max_tokens is not None:
            room = min(room, req.params.max_tokens - req.num_output_tokens - 1)
        return max(room, 0)


def _decoding(req: Request) -> bool:
    """Every token but the last has KV and the host knows them all: a draft can follow."""
    return (
        req.num_computed_tokens + 1 == req.num_tokens
        and not req.num_pending
        and not req.prefill_only
        and not req.is_finished
    )


def build_speculator(
    config: EngineConfig, target: ModelRunner, max_model_len: int
) -> Speculator | None:
    """The speculator of config.speculative (None: speculation off) for the target model."""
    spec = config.speculative
    if spec is None:
        return None
    drafter: Drafter
    if spec.method == "ngram":
        drafter = NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    elif spec.method == "mtp":
        drafter = MTPDrafter(config, target, max_model_len)
    else:
        drafter = DraftModelDrafter(config, target.model_config.vocab_size, max_model_len)
    return Speculator(spec, drafter, max_model_len)
