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

Cost isolation: some grammars make every fill dearer than the last (an ambiguous EBNF such as
``root ::= (a | a a)*`` with ``a ::= [a-z]*`` has xgrammar track more parses with each token),
and a fill in the step stalls every request of the batch. So each request's constraint work
(its fills and token accepts) is measured in thread CPU time: a request whose fill takes over
SLOW_FILL_S is filled *ahead* from then on, on one low-priority thread after each token, and
sits out of the steps (the scheduler skips it) until that mask is ready, so the rest of the
batch never waits for it; and a request whose constraint work adds up to more than its budget
(``EngineConfig.grammar_budget_s``) ends with finish_reason ``"error"`` and a stop_reason
saying so (the engine checks after each token).
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import torch
import xgrammar as xgr

from splitserve.engine.config import EngineConfig

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
SLOW_FILL_S = 0.005
"""A fill that takes longer (thread CPU time) moves its request's later fills ahead, off the
steps: five times a fill over a 128k vocabulary inside a JSON string."""
GRAMMAR_BUDGET_S = EngineConfig.grammar_budget_s


def _lowest_priority() -> None:
    # Linux takes a thread id for PRIO_PROCESS: the thread yields the CPU to the engine's
    # own threads on a busy host. Elsewhere the call fails and the thread keeps its priority.
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


FILL_AHEAD = ThreadPoolExecutor(1, "grammar-fill-ahead", initializer=_lowest_priority)
"""The one thread that fills the masks of the process's slow grammars, one after another."""


class RequestGrammar:
    """One request's xgrammar matcher over its compiled constraint, and what its work cost.

    budget_s: the thread CPU seconds its fills and accepts may take in all (``over_budget``).
    NOTE: while a mask is being filled ahead (``ready`` is False) only the fill-ahead thread
    touches the matcher; the scheduler keeps the request out of the steps until then."""

    def __init__(self, compiled: xgr.CompiledGrammar, budget_s: float = GRAMMAR_BUDGET_S) -> None:
        self.matcher = xgr.GrammarMatcher(compiled)
        self.budget_s = budget_s
        self.spent_s = 0.0
        self.deferred = False
        """Its fills are slow: each is made ahead, after the token before it (``fill_ahead``)."""
        self.probe = False
        """A threaded batch fill was slow: fill this one alone next time, timed."""
        self._accepted = 0
        self._ahead: Future[None] | None = None
        self._ahead_mask: torch.Tensor | None = None
        self._ahead_at = -1
        """The number of tokens accepted when _ahead_mask was filled."""

    def accept(self, token_id: int) -> bool:
        """Advance past a generated token; False if the grammar does not allow it."""
        start = time.thread_time()
        accepted = bool(self.matcher.accept_token(token_id))
        self.spent_s += time.thread_time() - start
        self._accepted += 1
        return accepted

    @property
    def is_terminated(self) -> bool:
        """The constraint is complete and its stop token was accepted: nothing may follow."""
        return bool(self.matcher.is_terminated())

    @property
    def over_budget(self) -> bool:
        return self.spent_s > self.budget_s

    def budget_message(self) -> str:
        return (
            f"the structured output constraint took more than its compute budget of "
            f"{self.budget_s:g} s (CPU time computing which tokens it allows) after "
            f"{self._accepted} tokens"
        )

    @property
    def ready(self) -> bool:
        """Its next mask can be had without waiting (none is being filled ahead)."""
        return self._ahead is None or self._ahead.done()

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Row of the host bitmask <- the tokens allowed next: the mask filled ahead if it is
        for this state, else filled now, timed (a slow fill defers the later ones)."""
        if self._ahead is not None:
            self._ahead.result()  # done unless the request skipped the scheduler's check
            self._ahead = None
        if self._ahead_mask is not None and self._ahead_at == self._accepted:
            bitmask[row].copy_(self._ahead_mask[0])
            return
        self.probe = False
        if self._timed_fill(bitmask, row) > SLOW_FILL_S and not self.deferred:
            self.deferred = True
            self._ahead_mask = bitmask[row : row + 1].clone()

    def fill_ahead(self) -> None:
        """A deferred grammar's next mask, started on the fill-ahead thread (called once the
        token before it is accepted); nothing for the others."""
        if not self.deferred:
            return
        assert self._ahead_mask is not None and self.ready
        at = self._accepted

        def run() -> None:
            assert self._ahead_mask is not None
            self._timed_fill(self._ahead_mask, 0)
            self._ahead_at = at

        self._ahead = FILL_AHEAD.submit(run)

    def _timed_fill(self, bitmask: torch.Tensor, row: int) -> float:
        start = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        elapsed = time.thread_time() - start
        self.spent_s += elapsed
        return elapsed


def wait_ahead(grammars: Sequence[RequestGrammar | None], timeout_s: float) -> None:
    """Wait at most timeout_s for one of the masks being filled ahead (for an engine with
    nothing else to do)."""
    pending = [g._ahead for g in grammars if g is not None and g._ahead is not None]
    if pending:
        wait(pending, timeout_s, FIRST_COMPLETED)


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
        with self._lock:
            slot = self._slot(logits, len(grammars))
            bitmask = slot.host[: len(grammars)]
            self.fill_grammars(bitmask, grammars)
            if logits.device.type == "cuda":
                bitmask = bitmask.to(logits.device, non_blocking=True)
                slot.copied = torch.cuda.Event()
                slot.copied.record(torch.cuda.current_stream(logits.device))
            xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)

    def fill_grammars(
        self, bitmask: torch.Tensor, grammars: Sequence[RequestGrammar | None]
    ) -> None:
        """Row i of the host bitmask <- what grammars[i] allows next (rows without a grammar
        untouched). Each grammar's fill is timed alone (``RequestGrammar.fill``) unless the
        rows go to xgrammar's threads together: a threaded fill over SLOW_FILL_S has its rows
        filled alone next time, to find the slow one; deferred rows are never in it."""
        alone: list[tuple[int, RequestGrammar]] = []
        together: list[tuple[int, RequestGrammar]] = []
        for row, grammar in enumerate(grammars):
            if grammar is not None:
                (alone if grammar.deferred or grammar.probe else together).append((row, grammar))
        if self._threaded(len(together)):
            start = time.perf_counter()
            self.fill(bitmask, [g.matcher for _, g in together], [row for row, _ in together])
            if time.perf_counter() - start > SLOW_FILL_S:
                for _, grammar in together:
                    grammar.probe = True
        else:
            alone += together
        for row, grammar in alone:
            grammar.fill(bitmask, row)

    def _threaded(self, rows: int) -> bool:
        return min(self.threads, rows) >= 2 and rows >= PARALLEL_ROWS

    def fill(
        self, bitmask: torch.Tensor, matchers: Sequence[xgr.GrammarMatcher], rows: list[int]
    ) -> None:
        """Row rows[i] of the host bitmask <- the tokens matchers[i] allows next."""
        threads = min(self.threads, len(rows))
        if not self._threaded(len(rows)):
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
