"""The engine's side of structured outputs: constraints compiled once per content against its
vocabulary, each request's matcher, and what each generated token does to it. Nothing here
imports xgrammar until the first constraint arrives (engines without one never load it)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from splitserve.engine.structured.grammar import GrammarCompiler
    from splitserve.engine.structured.matcher import RequestGrammar

log = logging.getLogger(__name__)

MASK_WAIT_S = 0.005
"""The longest an engine with nothing to schedule waits for a mask being filled ahead."""


class EngineConstraints:
    """budget_s: each request's constraint work, in CPU seconds (engine/structured/matcher.py)."""

    def __init__(
        self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int], budget_s: float
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.budget_s = budget_s
        self.compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled (GrammarError if it cannot be used). Thread-safe."""
        from splitserve.engine.structured.grammar import GrammarCompiler

        with self._lock:
            if self.compiler is None:
                self.compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self.compiler.compile(spec)

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher of the constraint, compiled once per content."""
        from splitserve.engine.structured.matcher import RequestGrammar

        return RequestGrammar(self.compile(spec), self.budget_s)

    @staticmethod
    def advance(req: Request, token: int) -> str | None:
        """Feed the request's matcher its new token: "stop" once nothing more may follow
        (done, or a token it refuses, logged: one sampled elsewhere without the constraint),
        "error" once its work passed the budget (its grammar's ``budget_message`` says so),
        else None."""
        grammar = req.grammar
        assert grammar is not None
        if not grammar.accept(token):
            log.error("request %s: token %d breaks its constraint", req.request_id, token)
            return "stop"
        if grammar.over_budget:
            return "error"
        return "stop" if grammar.is_terminated else None

    @staticmethod
    def wait_for_masks(running: Sequence[Request]) -> None:
        """Nothing could be scheduled: wait a moment for a mask being filled ahead rather
        than spin."""
        if any(r.grammar is not None for r in running):
            from splitserve.engine.structured.matcher import wait_ahead

            wait_ahead([r.grammar for r in running], MASK_WAIT_S)
