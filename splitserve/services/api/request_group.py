"""One API request's engine requests, as the HTTP handlers read them, and the errors they see."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

from splitserve.services import messages as msg


class QueueFullError(Exception):
    """The admission bound is reached; the caller should retry later."""


class EngineRequestError(Exception):
    """A worker refused or lost a request; the message says why.

    status: the HTTP status to answer with (400: the request itself is bad, 503: the service
    failed it, for example a KV transfer that did not complete or a worker that stopped;
    500: the API server could not handle the request's output).
    """

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


class RequestGroup:
    """The engine requests of one API request (n choices x prompts), read through one queue.

    Iterating yields (index, TokenDelta) until every request finished; ``close`` aborts the
    ones still running, so call it in a ``finally``.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[Sequence[str]], None]) -> None:
        """abort: stops requests that have not finished (RequestExchange.abort)."""
        self.request_ids = request_ids
        self.queue: asyncio.Queue[tuple[int, msg.TokenDelta | msg.RequestError]] = asyncio.Queue()
        self._abort = abort
        self._open = len(request_ids)
        self.on_close: Callable[[], None] | None = None
        """Called once, at the first ``close``."""

    def __aiter__(self) -> RequestGroup:
        return self

    async def __anext__(self) -> tuple[int, msg.TokenDelta]:
        if self._open == 0:
            raise StopAsyncIteration
        index, item = await self.queue.get()
        if isinstance(item, msg.RequestError):
            raise EngineRequestError(item.message, item.status)
        if item.finish_reason == "error":  # the engine ended it, its stop_reason says why
            raise EngineRequestError(str(item.stop_reason), 400)
        if item.finish_reason is not None:
            self._open -= 1
        return index, item

    def close(self) -> None:
        self._abort(self.request_ids)
        if self.on_close is not None:
            self.on_close()
            self.on_close = None
