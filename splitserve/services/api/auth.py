"""API keys: ``Authorization: Bearer <key>`` (or Anthropic's ``x-api-key: <key>``) on every /v1
route when keys are configured."""

from __future__ import annotations

import hmac

from fastapi import Request

from splitserve.services.api.errors import APIError


def check_api_key(request: Request) -> None:
    """FastAPI dependency: 401 unless the bearer token equals one of the configured keys.

    Every key is compared, each in constant time, so the time taken does not reveal which
    key (or how much of one) matched.
    """
    keys: tuple[str, ...] = request.app.state.server.config.server.api_keys
    if not keys:
        return
    matched = bearer_matches(request, keys)
    if not matched:
        raise APIError(
            401,
            "invalid or missing API key",
            "authentication_error",
            code="invalid_api_key",
            headers={"WWW-Authenticate": "Bearer"},
        )


def presented_key(request: Request) -> bytes:
    """The request's key: its bearer token, else its x-api-key header (empty without one)."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer":
        return token.strip().encode()
    return request.headers.get("x-api-key", "").strip().encode()


def bearer_matches(request: Request, keys: tuple[str, ...]) -> bool:
    """Whether the request's key (``presented_key``) is one of ``keys``, each compared in
    constant time."""
    presented = presented_key(request)
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched
