"""Admin routes: `GET /admin/pools`, `POST /admin/scale` (what `splitserve scale` calls).

With ``server.admin_keys`` configured they need one of those keys (an API key of
``server.api_keys`` is not enough: a client of the model may not resize the deployment).
Without admin keys they answer only when the server itself is bound to loopback
(``server.host``), and then only clients on the loopback interface (with the API key when
API keys are configured): a server bound elsewhere is reachable through a proxy on its own
host, whose clients all look like loopback. ``/admin/scale`` gives a pool at most
``server.max_replicas`` replicas.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from splitserve.services.api.auth import bearer_matches, check_api_key
from splitserve.services.api.errors import APIError
from splitserve.services.api.json_body import CheckedRoute

LOOPBACK = ("127.0.0.1", "::1", "localhost")


class ScaleError(ValueError):
    """A scale request that names no pool of the deployment or asks for no replicas (400)."""


class ScaleFailed(RuntimeError):
    """New replicas could not be placed or did not start (503)."""


class PoolScaler(Protocol):
    """What the admin routes resize. `splitserve serve` passes the launcher's Scaler
    (services/launch/scaling.py); the API knows only this interface."""

    def pools(self) -> dict[str, dict[str, Any]]:
        """Per pool name: {"role": ..., "workers": [ids of the workers taking requests]}."""
        ...

    async def scale(self, replicas: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        """Bring each pool (by name or role) to its number of replicas; returns pools().
        Raises ScaleError for a bad request and ScaleFailed when new replicas do not start."""
        ...


def check_admin(request: Request) -> None:
    server = request.app.state.server.config.server
    if server.admin_keys:
        if not bearer_matches(request, server.admin_keys):
            raise APIError(
                403, "admin routes need an admin key (server.admin_keys)", code="forbidden"
            )
        return
    if server.host not in LOOPBACK:
        raise APIError(
            403,
            f"admin routes need an admin key (server.admin_keys): the server is bound to "
            f"{server.host}, not loopback",
            code="forbidden",
        )
    host = request.client.host if request.client else ""
    if host not in LOOPBACK:
        raise APIError(
            403,
            "admin routes need an admin key (server.admin_keys) or a loopback client",
            code="forbidden",
        )
    check_api_key(request)


router = APIRouter(prefix="/admin", dependencies=[Depends(check_admin)], route_class=CheckedRoute)


class ScaleBody(BaseModel):
    """replicas: pool name or role -> the number of replicas it should have."""

    model_config = ConfigDict(extra="forbid")
    replicas: dict[str, int]


def get_scaler(request: Request) -> PoolScaler:
    scaler: PoolScaler | None = getattr(request.app.state, "scaler", None)
    if scaler is None:
        raise APIError(404, "this server cannot scale its workers", code="not_found")
    return scaler


@router.get("/pools")
async def pools(request: Request) -> dict[str, Any]:
    return {"pools": get_scaler(request).pools()}


@router.post("/scale")
async def scale(body: ScaleBody, request: Request) -> dict[str, Any]:
    scaler = get_scaler(request)
    bound = request.app.state.server.config.server.max_replicas
    for pool, count in body.replicas.items():
        if not 0 <= count <= bound:
            raise APIError(
                400,
                f"replicas.{pool}: {count} is outside [0, {bound}] (server.max_replicas)",
                param=f"replicas.{pool}",
                code="invalid_value",
            )
    try:
        return {"pools": await scaler.scale(body.replicas)}
    except ScaleError as exc:
        raise APIError(400, str(exc), param="replicas", code="invalid_value") from exc
    except ScaleFailed as exc:
        raise APIError(503, str(exc), "server_error", code="scale_failed") from exc
