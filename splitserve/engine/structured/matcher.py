"""A request's grammar state: which tokens may come next, advanced by every token appended.

The sampler masks a step's logits with ``apply_masks`` before it picks tokens: one bitmask for
the batch (rows without a grammar allow everything), filled on the host by each request's
matcher, copied to the logits' device and applied there, so requests with and without a
grammar share a step and greedy rows keep their argmax on the device.

The fill is the host's cost of a constrained step: a matcher in a state that leaves much of the
vocabulary open (inside a JSON string, say) takes about a millisecond over a 128k vocabulary.
With several constrained rows it runs on xgrammar's threads (``BatchGrammarMatcher``, one task a
row, the GIL released), otherwise serially. The bitmask buffers outlive the step: ``MASKS``
keeps them for the process, behind a lock (engines on threads of one process take turns).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import xgrammar as xgr

FILL_THREADS = max(1, min(8, (os.cpu_count() or 1) // 2))
"""The most threads that fill one bitmask (never more than the constrained rows): half the
logical CPUs, as xgrammar's own default, leaving the rest to the engine's loop and to SMT
siblings; 8 on a 16-core GPU host, 1 (serial) on a 2-core machine, where two threads measured
slower than one (benchmarks/structured/fill.py)."""
PARALLEL_ROWS = 4
"""With fewer constrained rows the fill is serial: xgrammar starts its threads on every call
(about 25 us each), which two or three rows, mostly in cheap states (a few us), don't repay."""
RING = 2
"""Pinned host buffers per device, used in turn: the copy from one may still be in flight
while the next step fills the other."""


class RequestGrammar:
    """One request's xgrammar matcher over its compiled constraint."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False if the grammar does not allow it."""
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())


@dataclass
class _Slot:
    """A host bitmask buffer and, on CUDA, the event of the last copy made from it."""

    host: torch.Tensor
    copied: torch.cuda.Event | None = None


class BatchMasks:
    """Fills a batch's bitmask and applies it to the batch's logits, in buffers kept from step
    to step: per (device, bitmask width) a buffer grown to the largest batch seen, for CUDA
    logits a ring of RING pinned ones used in turn. NOTE: a pinned buffer is refilled only once
    the copy last made from it has completed (its event), so no copy in flight reads a fill."""

    def __init__(self, threads: int = FILL_THREADS) -> None:
        self.threads = threads
        self._batch_matchers: dict[int, xgr.BatchGrammarMatcher] = {}
        self._rings: dict[tuple[torch.device, int], list[_Slot]] = {}
        self._lock = threading.Lock()

    def apply(self, logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
        """``apply_masks`` in these buffers."""
        rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
        if not rows:
            return
        matchers = [grammar.matcher for grammar in grammars if grammar is not None]
        with self._lock:
            slot = self._slot(logits, len(grammars))
            bitmask = slot.host[: len(grammars)]
            self.fill(bitmask, matchers, rows)
            if logits.device.type == "cuda":
                bitmask = bitmask.to(logits.device, non_blocking=True)
                slot.copied = torch.cuda.Event()
                slot.copied.record(torch.cuda.current_stream(logits.device))
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def fill(
        self, bitmask: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher], rows: list[int]
    ) -> None:
        """Row rows[i] of the host bitmask <- the tokens matchers[i] allows next."""
        threads = min(self.threads, len(rows))
        if threads < 2 or len(rows) < PARALLEL_ROWS:
            for row, matcher in zip(rows, matchers):
                matcher.fill_next_token_bitmask(bitmask, row)
            return
        if threads not in self._batch_matchers:
            self._batch_matchers[threads] = xgr.BatchGrammarMatcher(threads)
        self._batch_matchers[threads].batch_fill_next_token_bitmask(list(matchers), bitmask, rows)

    def _slot(self, logits: torch.Tensor, batch: int) -> _Slot:
        """The buffer this step fills, of at least batch rows, its last copy complete."""
        vocab = logits.shape[-1]
        pinned = logits.device.type == "cuda"
        ring = self._rings.setdefault((logits.device, xgr.get_bitmask_shape(1, vocab)[1]), [])
        if len(ring) < (RING if pinned else 1):
            slot = _Slot(_host_bitmask(batch, vocab, pinned))
        else:
            slot = ring.pop(0)  # the least recently used
        ring.append(slot)
        if slot.copied is not None:
            slot.copied.synchronize()
            slot.copied = None
        if slot.host.shape[0] < batch:
            slot.host = _host_bitmask(max(batch, 2 * slot.host.shape[0]), vocab, pinned)
        return slot


def _host_bitmask(rows: int, vocab: int, pinned: bool) -> torch.Tensor:
    bitmask = xgr.allocate_token_bitmask(rows, vocab)
    return bitmask.pin_memory() if pinned else bitmask


MASKS = BatchMasks()
"""The process's buffers: the sampler and the overlapped runner both mask through them."""


def apply_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """In place: the logits of tokens a row's grammar forbids become -inf (rows whose grammar
    is None are left alone). logits: [len(grammars), vocab]."""
    MASKS.apply(logits, grammars)
