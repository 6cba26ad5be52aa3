"""API keys: ``Authorization: Bearer <key>`` on every /v1 route when keys are configured."""

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


def bearer_matches(request: Request, keys: tuple[str, ...]) -> bool:
    """Whether the request's bearer token is one of ``keys``, each compared in constant time."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    presented = token.strip().encode() if scheme.lower() == "bearer" else b""
    matched = False
    for key in keys:
        matched |= hmac.compare_digest(presented, key.encode())
    return matched
