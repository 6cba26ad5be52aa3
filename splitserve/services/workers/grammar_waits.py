"""Requests with structured outputs wait here while their grammar compiles off the loop.

A worker's loop must keep stepping while a constraint it has not seen compiles (up to the
compile bound, engine/structured/grammar.py). A message that carries such a constraint
(a GenerateRequest, a Prefill, a Reserve) is held and its grammar compiled on a thread into the
engine's cache; the loop hands it on once that is done, so that the engine finds the grammar
compiled, or fails it with the compile's error. Messages are handed on in arrival order.
"""

from __future__ import annotations

import collections
import concurrent.futures
from collections.abc import Callable
from typing import Any

from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.services import messages as msg


class GrammarWaits:
    def __init__(self, compile_grammar: Callable[[StructuredOutputsParams], Any]) -> None:
        self._compile = compile_grammar
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="grammar")
        self._held: collections.OrderedDict[str, tuple[msg.Message, concurrent.futures.Future]]
        self._held = collections.OrderedDict()

    def hold(self, message: msg.Message) -> bool:
        """Keep the message while its constraint compiles; False if it has none."""
        params = getattr(message, "params", None)
        spec = params.structured_outputs if params is not None else None
        if spec is None:
            return False
        request_id: str = getattr(message, "request_id")  # noqa: B009 (the three types have it)
        self._held[request_id] = (message, self._pool.submit(self._compile, spec))
        return True

    def ready(self) -> list[tuple[str, msg.Message, ValueError | None]]:
        """(request id, message, its compile error or None) of the held messages whose
        grammar is done, up to the first one still compiling."""
        done = []
        while self._held:
            request_id, (message, future) = next(iter(self._held.items()))
            if not future.done():
                break
            del self._held[request_id]
            error = future.exception()
            if error is not None and not isinstance(error, ValueError):
                raise error  # not the constraint's fault: the worker's loop stops on it
            done.append((request_id, message, error))
        return done

    def discard(self, request_ids: list[str]) -> None:
        """Aborted while compiling: dropped (the compile still fills the cache)."""
        for request_id in request_ids:
            self._held.pop(request_id, None)

    def held(self) -> list[str]:
        return list(self._held)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
