"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status;
on Anthropic's paths (/v1/messages and below) Anthropic's shape, ``{"type": "error",
"error": {"type", "message"}}``, its type named by the status.

Every failure path of the app ends here, so a bad request gets a clear answer and the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic_core import PydanticCustomError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger("splitserve.api")
request_log = logging.getLogger("splitserve.requests")
MAX_LOGGED_CHARS = 300
"""Of a refused request's error message, what its log line keeps."""


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def field_error(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error of a model validator that names its field (``_from_validation``
    reads ``param`` and ``code`` back: a model-level error has no location of its own)."""
    return PydanticCustomError(code, message, {"param": param})


def error_body(message: str, type: str, param: str | None, code: str | None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_TYPES = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def anthropic_body(exc: APIError) -> dict[str, Any]:
    """Anthropic's error body: invalid_request_error for a 4xx it names no other type for,
    api_error for a 5xx."""
    default = "invalid_request_error" if exc.status < 500 else "api_error"
    kind = ANTHROPIC_TYPES.get(exc.status, default)
    return {"type": "error", "error": {"type": kind, "message": exc.message}}


def error_response(exc: APIError, path: str = "") -> JSONResponse:
    """The error as the API at ``path`` shapes it."""
    if path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/"):
        body = anthropic_body(exc)
    else:
        body = error_body(exc.message, exc.type, exc.param, exc.code)
    return JSONResponse(body, status_code=exc.status, headers=exc.headers)


def install_error_handlers(app: FastAPI) -> None:
    """Turn validation errors, HTTP errors and crashes into OpenAI error bodies."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return refusal(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return refusal(request, _from_validation(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        code = {BodyTooLarge: "body_too_large", BodyTimeout: "body_timeout"}.get(type(exc))
        return refusal(request, APIError(exc.status_code, str(exc.detail), kind, code=code))

    @app.exception_handler(Exception)
    async def _crash(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        crash = APIError(500, "internal server error", "server_error")
        return error_response(crash, request.url.path)


def refusal(request: Request, exc: APIError) -> JSONResponse:
    """The error's response, and one line on the request log for each refused request (4xx;
    the message cut to MAX_LOGGED_CHARS, whatever the request held)."""
    if 400 <= exc.status < 500:
        line = {
            "path": request.url.path,
            "status": exc.status,
            "code": exc.code,
            "message": exc.message[:MAX_LOGGED_CHARS],
        }
        request_log.info(json.dumps({"refused": line}))
    return error_response(exc, request.url.path)


def _from_validation(exc: RequestValidationError) -> APIError:
    """The first error, named by its field: a model validator's error carries the field in
    its context (field_error); one about the whole body says what the body is."""
    first = exc.errors()[0] if exc.errors() else {}
    kind = str(first.get("type", "invalid_value"))
    if kind == "json_invalid":
        return APIError(400, "the request body is not valid JSON", code="invalid_json")
    message = str(first.get("msg", "invalid request")).removeprefix("Value error, ")
    context = first.get("ctx") or {}
    if "param" in context:
        return APIError(400, message, param=str(context["param"]), code=kind)
    param = _param_name([str(p) for p in first.get("loc", ()) if p != "body"])
    if param is None:
        return APIError(400, "the request body must be a JSON object", code="invalid_value")
    return APIError(400, f"{param}: {message}", param=param, code="invalid_value")


def _param_name(loc: list[str]) -> str | None:
    """'messages.0.content' style names, without pydantic's union branch labels."""
    tags = {"str", "int", "float", "bool", "list", "dict", "none"}
    parts = [p for p in loc if p not in tags and "[" not in p and "-" not in p]
    return ".".join(parts) or None


class BodyTooLarge(StarletteHTTPException):
    """A body found over the limit while it is read; FastAPI passes an HTTP error raised by
    its body reading through to the handler, which answers ``body_too_large``."""

    def __init__(self, max_bytes: int) -> None:
        super().__init__(400, f"the request body is larger than the limit of {max_bytes} bytes")


class BodyTimeout(StarletteHTTPException):
    """A body that did not arrive in time (a client that sends half and waits would hold its
    connection and the request's handler for ever)."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(408, f"the request body did not arrive within {timeout_s:g} s")


class BodyLimitMiddleware:
    """Refuse request heads over ``max_header_bytes`` (431) and bodies over ``max_bytes``
    (400), by Content-Length before the body is read or, for a chunked body, once its
    chunks add up to more than the limit; and bodies not complete ``timeout_s`` after the
    app starts reading them (408, the connection then closed by the server)."""

    def __init__(
        self, app: ASGIApp, max_bytes: int, max_header_bytes: int, timeout_s: float
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.max_header_bytes = max_header_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refused = self._refusal(scope.get("headers", []))
        if refused is not None:
            await error_response(refused, scope.get("path", ""))(scope, receive, send)
            return
        received = 0
        deadline: float | None = None
        complete = False

        async def limited_receive() -> Message:
            nonlocal received, deadline, complete
            if complete:  # later reads wait for a disconnect: no deadline
                return await receive()
            loop = asyncio.get_running_loop()
            deadline = deadline or loop.time() + self.timeout_s
            try:
                message = await asyncio.wait_for(receive(), deadline - loop.time())
            except TimeoutError:
                raise BodyTimeout(self.timeout_s) from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
                complete = not message.get("more_body", False)
            return message

        await self.app(scope, limited_receive, send)

    def _refusal(self, headers: list[tuple[bytes, bytes]]) -> APIError | None:
        size = sum(len(name) + len(value) for name, value in headers)
        if size > self.max_header_bytes:
            message = f"the request headers are larger than the limit of {self.max_header_bytes}"
            return APIError(431, message + " bytes", code="headers_too_large")
        length = dict(headers).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return APIError(400, BodyTooLarge(self.max_bytes).detail, code="body_too_large")
        return None
