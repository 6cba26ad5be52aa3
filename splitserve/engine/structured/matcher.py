"""A request's grammar state: which tokens may come next, advanced by every token appended.

The sampler masks a step's logits with ``apply_masks`` before it picks tokens: one bitmask for
the batch (rows without a grammar allow everything), filled on the host by each request's
matcher, copied to the logits' device and applied there, so requests with and without a
grammar share a step and greedy rows keep their argmax on the device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xgrammar as xgr


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

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def apply_masks(logits: torch.Tensor, grammars: Sequence[RequestGrammar | None]) -> None:
    """In place: the logits of tokens a row's grammar forbids become -inf (rows whose grammar
    is None are left alone). logits: [len(grammars), vocab]."""
    rows = [row for row, grammar in enumerate(grammars) if grammar is not None]
    if not rows:
        return
    bitmask = xgr.allocate_token_bitmask(len(grammars), logits.shape[-1])
    for row in rows:
        grammar = grammars[row]
        assert grammar is not None
        grammar.fill(bitmask, row)
    if logits.device.type == "cuda":
        bitmask = bitmask.pin_memory().to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
