"""The FastAPI app: OpenAI routes plus /health, /metrics and /admin."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse

from splitserve.services.api import admin, chat, completions, messages_api, responses
from splitserve.services.api.auth import check_api_key
from splitserve.services.api.errors import BodyLimitMiddleware, install_error_handlers
from splitserve.services.api.serving import ServerState, get_state
from splitserve.services.metrics import CONTENT_TYPE

_CREATED = int(time.time())
log = logging.getLogger("splitserve.api")


def build_app(state: ServerState, scaler: admin.PoolScaler | None = None) -> FastAPI:
    """An app serving ``state``; the caller starts ``state.exchange`` on the serving loop.
    With a ``scaler``, /admin/scale resizes the pools live."""
    app = FastAPI(title="splitserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.server = state
    app.state.scaler = scaler
    install_error_handlers(app)
    server = state.config.server
    if server.host not in admin.LOOPBACK and not server.api_keys:
        log.warning(
            "the API listens on %s without server.api_keys: anyone who reaches the port can "
            "use the model",
            server.host,
        )
    app.add_middleware(
        BodyLimitMiddleware,
        max_bytes=server.max_body_bytes,
        max_header_bytes=server.max_header_bytes,
        timeout_s=server.body_timeout_s,
    )
    app.include_router(chat.router)
    app.include_router(completions.router)
    app.include_router(responses.router)
    app.include_router(messages_api.router)
    app.include_router(admin.router)
    app.add_api_route(
        "/v1/models", list_models, methods=["GET"], dependencies=[Depends(check_api_key)]
    )
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


async def list_models(request: Request) -> dict[str, Any]:
    state = get_state(request)
    card = {
        "id": state.model_name,
        "object": "model",
        "created": _CREATED,
        "owned_by": "splitserve",
        "max_model_len": state.max_model_len,
    }
    return {"object": "list", "data": [card]}


async def health(request: Request) -> Response:
    """200 only when every worker has sent a recent heartbeat; the body has each pool's count.

    Pools are keyed by role: {"prefill": {"status", "replicas", "ready"}, "decode": ...}.
    """
    workers = get_state(request).exchange.pool
    pools: dict[str, Any] = {
        role: {"status": "ok" if p["ready"] == p["replicas"] else "unavailable", **p}
        for role, p in workers.pools().items()
    }
    body = {
        "status": "ok" if workers.ready else "unavailable",
        "workers_ready": workers.num_ready,
        "pools": pools,
    }
    return JSONResponse(body, status_code=200 if workers.ready else 503)


async def metrics(request: Request) -> Response:
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)
