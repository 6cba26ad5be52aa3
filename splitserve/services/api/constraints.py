"""The API server's check of structured-output constraints, before any request reaches a worker.

Each distinct constraint is compiled once here, with the API server's tokenizer and bounded in
time (``server.grammar_timeout_s``), exactly as a worker's engine compiles it, so a schema,
regex or grammar that is invalid, unsupported, too large or too slow to compile is a 400 and
never occupies a worker. Compilation runs on a thread (never on the event loop), and xgrammar
(with torch) is imported with the first constrained request, not before.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import OrderedDict
from typing import Any

from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.services.api.errors import APIError

REFUSED_CACHE = 256
REFUSED_FOR_S = 60.0
"""Refused constraints (at most REFUSED_CACHE) are answered for this long without compiling
again: a slow one would otherwise start a compile that cannot be interrupted on every retry,
and one refused for time on a busy server is tried again after it."""


class ConstraintError(ValueError):
    """Why a constraint cannot be used."""


class ConstraintCheck:
    """Compiles constraints against the served model's vocabulary; thread-safe."""

    def __init__(self, tokenizer: Any, timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self._compiler: Any = None
        self._refused: OrderedDict[tuple[str, str], tuple[str, float]] = OrderedDict()
        self._lock = threading.Lock()

    async def check(self, spec: StructuredOutputsParams, param: str) -> None:
        """400 naming ``param`` and the reason if ``spec`` cannot be compiled in time."""
        await self._run(self.compile, spec, param)

    async def check_schemas(self, schemas: list[tuple[str, dict[str, Any]]]) -> None:
        """400 naming the first of (param, JSON schema) that is not a usable schema."""
        for param, schema in schemas:
            await self._run(self.parse, StructuredOutputsParams(json=schema), param)

    async def _run(self, check: Any, spec: StructuredOutputsParams, param: str) -> None:
        try:
            await asyncio.to_thread(check, spec)
        except ConstraintError as exc:
            raise APIError(400, f"{param}: {exc}", param=param, code="invalid_value") from None

    def parse(self, spec: StructuredOutputsParams) -> None:
        """The tokenizer-free check (engine/structured/grammar.py ``parse``)."""
        from splitserve.engine.structured.grammar import GrammarError, parse

        try:
            parse(spec)
        except (GrammarError, RecursionError) as exc:
            raise ConstraintError(_reason(exc)) from None

    def compile(self, spec: StructuredOutputsParams) -> None:
        """The whole compile, cached by content (the compiler's cache), refusals too."""
        from splitserve.engine.structured.grammar import GrammarError, source

        try:
            key = source(spec)
        except (GrammarError, RecursionError) as exc:
            raise ConstraintError(_reason(exc)) from None
        with self._lock:
            reason, until = self._refused.get(key, ("", 0.0))
        if time.monotonic() < until:
            raise ConstraintError(reason)
        try:
            self._get_compiler().compile(spec, self.timeout_s)
        except (GrammarError, RecursionError) as exc:
            self._refuse(key, _reason(exc))
            raise ConstraintError(_reason(exc)) from None

    def _refuse(self, key: tuple[str, str], reason: str) -> None:
        with self._lock:
            self._refused[key] = (reason, time.monotonic() + REFUSED_FOR_S)
            self._refused.move_to_end(key)
            while len(self._refused) > REFUSED_CACHE:
                self._refused.popitem(last=False)

    def _get_compiler(self) -> Any:
        from splitserve.engine.loader import eos_token_ids
        from splitserve.engine.structured.grammar import GrammarCompiler

        with self._lock:
            if self._compiler is None:
                eos = list(eos_token_ids(self.tokenizer))
                self._compiler = GrammarCompiler(self.tokenizer, len(self.tokenizer), eos)
            return self._compiler


def _reason(exc: Exception) -> str:
    return "the constraint is nested too deeply" if isinstance(exc, RecursionError) else str(exc)
