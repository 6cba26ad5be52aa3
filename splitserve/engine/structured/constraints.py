"""An engine's structured-output constraints: compiled once per content against the engine's
vocabulary, a fresh matcher per request, each sampled token fed to it. xgrammar loads with the
first constraint (grammar.py and matcher.py import it), so an engine that never sees one never
imports it."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from splitserve.engine.request import Request
from splitserve.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from xgrammar import CompiledGrammar

    from splitserve.engine.structured.grammar import GrammarCompiler
    from splitserve.engine.structured.matcher import RequestGrammar

log = logging.getLogger(__name__)

MASK_WAIT_S = 0.005
"""The longest an idle step waits for a mask being filled ahead."""


class Constraints:
    def __init__(self, tokenizer: Any, vocab_size: int, eos: Iterable[int], budget_s: float):
        self._tokenizer, self._vocab_size, self._eos = tokenizer, vocab_size, list(eos)
        self._budget_s = budget_s
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputsParams) -> CompiledGrammar:
        """The constraint compiled into the cache that ``matcher`` reads (GrammarError, a
        ValueError, if it cannot be used). Thread-safe: a worker compiles on a thread of its own
        before it adds the request."""
        from splitserve.engine.structured.grammar import GrammarCompiler

        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler(self._tokenizer, self._vocab_size, self._eos)
        return self._compiler.compile(spec)

    def matcher(self, spec: StructuredOutputsParams) -> RequestGrammar:
        """A fresh matcher of the constraint, with the per-request budget of constraint work."""
        from splitserve.engine.structured.matcher import RequestGrammar

        return RequestGrammar(self.compile(spec), self._budget_s)

    @staticmethod
    def advance(req: Request, token: int) -> bool:
        """Feed the token to the request's matcher; True once nothing more may follow (done,
        or a token it refuses, logged: one sampled elsewhere without the constraint)."""
        assert req.grammar is not None
        if not req.grammar.accept(token):
            log.error("request %s: token %d breaks its constraint", req.request_id, token)
            return True
        return req.grammar.is_terminated

    @staticmethod
    def wait_for_masks(running: Iterable[Request]) -> None:
        """Nothing could be scheduled: wait a moment for a mask being filled ahead rather than
        spin (matcher.py)."""
        grammars = [r.grammar for r in running if r.grammar is not None]
        if grammars:
            from splitserve.engine.structured.matcher import wait_ahead

            wait_ahead(grammars, MASK_WAIT_S)
