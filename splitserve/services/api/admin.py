"""Admin routes: `GET /admin/pools`, `POST /admin/scale` (what `splitserve scale` calls).

They take the API key when keys are configured; without keys they answer only clients on
the loopback interface, so that an open port does not let anyone resize the deployment.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from splitserve.services.api.auth import check_api_key
from splitserve.services.api.errors import APIError
from splitserve.services.launch.deployment import WorkerStartError
from splitserve.services.launch.scaling import ScaleError, Scaler

LOOPBACK = ("127.0.0.1", "::1", "localhost")


def check_admin(request: Request) -> None:
    check_api_key(request)
    keys = request.app.state.server.config.server.api_keys
    host = request.client.host if request.client else ""
    if not keys and host not in LOOPBACK:
        raise APIError(403, "admin routes need an API key or a loopback client", code="forbidden")


router = APIRouter(prefix="/admin", dependencies=[Depends(check_admin)])


class ScaleBody(BaseModel):
    """replicas: pool name or role -> the number of replicas it should have."""

    model_config = ConfigDict(extra="forbid")
    replicas: dict[str, int]


def get_scaler(request: Request) -> Scaler:
    scaler: Scaler | None = getattr(request.app.state, "scaler", None)
    if scaler is None:
        raise APIError(404, "this server cannot scale its workers", code="not_found")
    return scaler


@router.get("/pools")
async def pools(request: Request) -> dict[str, Any]:
    return {"pools": get_scaler(request).pools()}


@router.post("/scale")
async def scale(body: ScaleBody, request: Request) -> dict[str, Any]:
    scaler = get_scaler(request)
    try:
        return {"pools": await scaler.scale(body.replicas)}
    except ScaleError as exc:
        raise APIError(400, str(exc), param="replicas", code="invalid_value") from exc
    except WorkerStartError as exc:
        raise APIError(503, str(exc), "server_error", code="scale_failed") from exc
