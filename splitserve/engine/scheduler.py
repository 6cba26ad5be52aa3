"""Continuous batching with chunked prefill under one token budget per step.

Running requests go first (a decode costs one token, or one plus its draft tokens when it
speculates; an unfinished prefill takes what the budget leaves), then waiting requests are
admitted in arrival order. When the KV pool runs out, the newest running request is
preempted: its blocks are freed and it is recomputed later. A running request whose grammar
mask is still being filled ahead (engine/structured/matcher.py) sits the step out.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Request, RequestStatus


@dataclass
class ScheduledBatch:
    """This step's work: each request with the number of new tokens it computes."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    num_preempted: int = 0

    def add(self, req: Request, num_new_tokens: int) -> None:
        self.requests.append(req)
        self.num_new_tokens.append(num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.prompt_tokens_cached = 0
        self.prompt_tokens_queried = 0
        self.cached_tokens_by_tier: dict[str, int] = {}

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if not batch.num_preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            req = self.running[index]
            if req.grammar is not None and not req.grammar.ready:
                index += 1
                continue
            num_new = self._fit_drafts(req, budget)
            while not self.block_manager.allocate_slots(req, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                batch.num_preempted += 1
                if victim is req:
                    return budget
            batch.add(req, num_new)
            budget -= num_new
            index += 1
        return budget

    def _fit_drafts(self, req: Request, budget: int) -> int:
        """req's tokens this step: its drafts (engine/spec/) only where the budget and free
        blocks allow them; speculation never preempts anyone."""
        drafts = req.draft_token_ids
        num_new = min(req.num_tokens - req.num_computed_tokens + len(drafts), budget)
        del drafts[max(num_new - 1, 0) :]
        if drafts and not self.block_manager.allocate_slots(req, num_new):
            num_new -= len(drafts)
            drafts.clear()
        return num_new

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not req.block_table:
                req.num_computed_tokens = self.block_manager.allocate_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.block_manager.allocate_slots(req, num_new) and not self._make_room(
                req, num_new
            ):
                self.block_manager.free(req)
                req.num_computed_tokens = 0
                return
            self.waiting.popleft()
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = req.num_computed_tokens
                self.prompt_tokens_cached += req.num_computed_tokens
                self._count_hits(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.add(req, num_new)
            budget -= num_new

    def _count_hits(self, req: Request) -> None:
        if not self.block_manager.enable_prefix_caching:
            return
        self.prompt_tokens_queried += req.num_prompt_tokens
        for tier, tokens in self.block_manager.last_hit_tokens.items():
            self.cached_tokens_by_tier[tier] = self.cached_tokens_by_tier.get(tier, 0) + tokens

    def queued_prompt_tokens(self) -> int:
        """Prompt tokens admitted here whose KV is not computed yet; a request that has not
        claimed its blocks yet counts without the prefix the device cache holds for it."""
        total = 0
        for queue in (self.waiting, self.running):
            for r in queue:
                done = r.num_computed_tokens
                if not r.block_table:
                    done = self.block_manager.cached_prefix_tokens(r)
                total += max(r.num_prompt_tokens - done, 0)
        return total

    def _make_room(self, head: Request, num_new: int) -> bool:
        """Nothing runs and the head of the queue cannot start: take blocks back from the
        newest waiting requests that hold some (KV adopted from a prefill worker, say);
        they are recomputed later. Without this, waiting requests could hold the whole pool
        while none of them can ever run."""
        if self.running:
            return False
        for other in reversed(self.waiting):
            if other is head or not other.block_table:
                continue
            self.block_manager.free(other)
            other.num_computed_tokens = 0
            self.num_preemptions += 1
            if self.block_manager.allocate_slots(head, num_new):
                return True
        return False

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req)
        req.draft_token_ids.clear()
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request) -> None:
        """Drop a finished or aborted request and release its blocks."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.block_manager.free(req)
        self.block_manager.forget(req.request_id)
