"""Request bodies checked as JSON before any model reads them: no lone surrogate in any string
(``"\\ud800"`` is valid JSON but not Unicode: the tokenizer, msgpack and the response encoder
all fail on it) and no nesting past MAX_DEPTH (a chat template recurses into tools' schemas;
Python's parser itself gives up near 1,000). Every route of the app uses ``CheckedRoute``."""

from __future__ import annotations

import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from splitserve.services.api.errors import APIError

MAX_DEPTH = 64
"""The deepest a body's arrays and objects may nest (a schema of ~30 levels in a tool)."""


def problem(value: Any, max_depth: int = MAX_DEPTH) -> APIError | None:
    """The 400 for the first surrogate or the first nesting past max_depth in a parsed JSON
    value (walked without recursion), or None."""
    stack: list[tuple[Any, str, int]] = [(value, "", 0)]
    while stack:
        node, path, depth = stack.pop()
        if isinstance(node, str):
            if not _is_unicode(node):
                return _surrogate(path)
            continue
        if not isinstance(node, dict | list):
            continue
        if depth >= max_depth:
            return APIError(
                400,
                f"{path or 'body'}: nested deeper than {max_depth} levels",
                param=path or None,
                code="nesting_too_deep",
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            child_path = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and not _is_unicode(key):
                return _surrogate(path)
            stack.append((child, child_path, depth + 1))
    return None


def surrogate_free(value: Any) -> bool:
    """No string in the JSON value holds a lone surrogate (any depth it has)."""
    try:
        json.dumps(value, ensure_ascii=False).encode()
    except (UnicodeEncodeError, RecursionError, ValueError):
        return False
    return True


def _is_unicode(text: str) -> bool:
    if text.isascii():
        return True
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _surrogate(path: str) -> APIError:
    return APIError(
        400,
        f"{path or 'body'}: a string holds a lone UTF-16 surrogate (such as \\ud800), which is "
        "not valid Unicode",
        param=path or None,
        code="invalid_unicode",
    )


class CheckedRoute(APIRoute):
    """A route whose JSON body is parsed here first (FastAPI reuses the parse) and refused
    with a 400 for surrogates or depth; a body that is not JSON is left to FastAPI's own
    error."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            if await request.body():
                await _check(request)
            return await handler(request)

        return checked


async def _check(request: Request) -> None:
    try:
        body = await request.json()
    except RecursionError:
        raise APIError(
            400,
            f"body: nested deeper than {MAX_DEPTH} levels",
            code="nesting_too_deep",
        ) from None
    except ValueError:  # not JSON (or not UTF-8): FastAPI answers it
        return
    found = problem(body)
    if found is not None:
        raise found
