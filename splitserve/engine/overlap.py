"""Overlapped decode steps: the host schedules and prepares step N+1 while the device runs N.

Only decode steps of plain greedy requests overlap: their next token is an argmax the device
takes itself, so step N's sampled tokens can feed step N+1's inputs without the host reading
them first. The host reads them one step later, from one copy into pinned memory, to append
them, detokenize and check stops. Anything else (a prompt to compute, a new request, logprobs,
penalties, random sampling, too few free blocks) first waits for the step in flight and then
runs synchronously, so the synchronous engine is the only one that ever sees those cases.

A step with structured-output requests overlaps too, in two launches: the step's logits first;
then, once the host has read step N's tokens and advanced the grammars with them (while the
device computes N+1's logits), the batch's grammar bitmask, applied on the device before the
argmax.

A request found finished in step N has already been put into step N+1. Its extra token is
dropped when N+1 is read; the KV slot that N+1 wrote is one of the request's own blocks (its
last one, not yet full, or a fresh one), which nothing reads before it is reallocated and
overwritten in stream order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from splitserve.engine.request import Request
from splitserve.engine.sampler import plain_greedy
from splitserve.engine.scheduler import ScheduledBatch, Scheduler


@dataclass
class InflightStep:
    """A launched decode step whose sampled tokens the host has not read yet."""

    batch: ScheduledBatch
    tokens: torch.Tensor
    """The sampled token ids on the device, one per request of the batch, in batch order."""
    host: torch.Tensor
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, batch: ScheduledBatch, tokens: torch.Tensor) -> InflightStep:
        """Begin copying ``tokens`` to the host without waiting for the device."""
        if tokens.device.type != "cuda":
            return cls(batch, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        return cls(batch, tokens, host, event)

    def token_ids(self) -> list[int]:
        """Wait for this step alone (not for anything launched after it)."""
        if self.event is not None:
            self.event.synchronize()
        return [int(t) for t in self.host.tolist()]

    def row_of(self) -> dict[int, int]:
        """id(request) -> its row in this step."""
        return {id(req): row for row, req in enumerate(self.batch.requests)}


def overlappable(req: Request) -> bool:
    """The device can choose this request's next token: a plain argmax (under the request's
    grammar mask, filled by the host while the device computes the step's logits; not one
    whose masks are filled ahead, which sits out steps until its mask is ready)."""
    deferred = req.grammar is not None and req.grammar.deferred
    return plain_greedy(req) and not req.prefill_only and not req.is_finished and not deferred


def is_decode_batch(batch: ScheduledBatch, max_batch: int) -> bool:
    """Every request computes exactly its last token, and all of them may overlap."""
    return (
        0 < len(batch.requests) <= max_batch
        and all(n == 1 for n in batch.num_new_tokens)
        and all(
            req.num_computed_tokens + 1 == req.num_tokens and overlappable(req)
            for req in batch.requests
        )
    )


def can_continue(scheduler: Scheduler, inflight: InflightStep, max_batch: int) -> bool:
    """The next schedule() will be exactly one more decode step of the requests in flight:
    nothing waits, nothing finished or was aborted meanwhile, and every request gets the
    block its next token needs without preempting anyone."""
    running: Sequence[Request] = scheduler.running
    if scheduler.waiting or len(running) > max_batch:
        return False
    if len(running) != len(inflight.batch.requests):
        return False
    in_flight = inflight.row_of()
    if any(id(req) not in in_flight or not overlappable(req) for req in running):
        return False
    manager = scheduler.block_manager
    needed = sum(
        max(manager.blocks_needed(req.num_computed_tokens + 1) - len(req.block_table), 0)
        for req in running
    )
    return needed <= manager.num_free_blocks
