"""The API's edges (issue 48, finding 8), in-process: a half-sent body is dropped after
``server.body_timeout_s``; one client cannot hold more than its share of the admission bound
(429 with Retry-After) nor send one request for more (400); ``best_of`` is strict;
``stop_token_ids`` is checked; a public bind without API keys is warned about."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from splitserve.config import DeployConfig
from splitserve.server_config import ServerConfig
from splitserve.services.api.app import build_app
from splitserve.services.api.errors import BodyLimitMiddleware, install_error_handlers
from splitserve.services.api.json_body import CheckedRoute
from splitserve.services.api.protocol import CompletionRequest
from splitserve.services.api.serving import ServerState
from splitserve.services.metrics import Metrics
from tests.support.api_harness import MODEL, api_over_fake_workers
from tests.support.wait import wait_for_async

TIMEOUT_S = 0.3


def body_app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=4096, max_header_bytes=1024, timeout_s=0.3)
    router = APIRouter(route_class=CheckedRoute)

    @router.post("/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return {"stop_token_ids": body.stop_token_ids}

    app.include_router(router)
    return app


async def half_sent(app: FastAPI) -> tuple[list[dict[str, Any]], float]:
    """A request whose Content-Length promises 100 bytes and that sends 10, then nothing."""
    parts = [{"type": "http.request", "body": b'{"model": ', "more_body": True}]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        if parts:
            return parts.pop(0)
        await asyncio.sleep(3600)
        raise AssertionError("unreachable")

    async def send(message: Any) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/completions",
        "raw_path": b"/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"100")],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }
    start = time.monotonic()
    await asyncio.wait_for(app(scope, receive, send), 10)
    return sent, time.monotonic() - start


def test_a_half_sent_body_is_answered_408_after_the_body_timeout() -> None:
    sent, seconds = asyncio.run(half_sent(body_app()))
    assert sent[0]["status"] == 408
    assert b'"code":"body_timeout"' in sent[1]["body"]
    assert b"did not arrive within 0.3 s" in sent[1]["body"]
    assert TIMEOUT_S <= seconds < TIMEOUT_S + 1


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ({"best_of": True}, 400),
        ({"best_of": 2}, 400),
        ({"best_of": 1.0}, 400),
        ({"best_of": 2, "n": 2}, 200),
        ({"best_of": 1}, 200),
        ({"stop_token_ids": [True]}, 400),
        ({"stop_token_ids": [-1]}, 400),
        ({"stop_token_ids": list(range(17))}, 400),
        ({"stop_token_ids": [2, 7]}, 200),
    ],
)
def test_best_of_is_strict_and_stop_token_ids_are_checked(
    fields: dict[str, Any], status: int
) -> None:
    with TestClient(body_app()) as client:
        body = {"model": MODEL, "prompt": "a", **fields}
        response = client.post("/completions", json=body)
    assert response.status_code == status, response.text
    if "best_of" in fields and status == 400:
        n = fields.get("n", 1)
        assert response.json()["error"] == {
            "message": f"best_of must be absent or equal n ({n}): choosing the best of more "
            "samples than are returned is not supported by this server",
            "type": "invalid_request_error",
            "param": "best_of",
            "code": "unsupported_parameter",
        }


def state_of(server: ServerConfig, exchange: Any = None) -> ServerState:
    return ServerState(DeployConfig(server=server), None, exchange, Metrics(MODEL), 2048)


def test_a_public_bind_without_api_keys_is_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, "splitserve.api"):
        build_app(state_of(ServerConfig(host="0.0.0.0")))
        build_app(state_of(ServerConfig(host="0.0.0.0", api_keys=("k",))))
        build_app(state_of(ServerConfig()))
    assert [r.getMessage() for r in caplog.records] == [
        "the API listens on 0.0.0.0 without server.api_keys: anyone who reaches the port can "
        "use the model"
    ]


class Tokenizer:
    """Enough of a tokenizer for completions of token ids: a vocabulary size."""

    def __len__(self) -> int:
        return 100


async def share_outcome() -> dict[str, Any]:
    """max_queue 4, client_share 0.5: key A holds 2 (never answered), then asks for a third;
    key B asks for one; and one request of 3 prompts."""
    server = ServerConfig(api_keys=("a", "b"), max_queue=4, client_share=0.5)
    held: list[asyncio.Task[httpx.Response]] = []
    async with api_over_fake_workers(
        DeployConfig(server=server), Tokenizer(), {"worker-0": "both"}
    ) as api:

        def post(key: str, prompt: Any) -> Any:
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            return api.http.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )

        try:
            held = [asyncio.create_task(post("a", [1, 2])) for _ in range(2)]
            await wait_for_async(lambda: api.exchange.num_admitted == 2, 5.0, message="a: 2")
            third = await post("a", [1, 2])
            held.append(asyncio.create_task(post("b", [1, 2])))
            await wait_for_async(lambda: api.exchange.num_admitted == 3, 5.0, message="b: 1")
            many = await post("b", [[1], [2], [3]])
            return {"third": third, "many": many, "held": dict(api.state.shares.held)}
        finally:
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)


def test_a_client_past_its_share_of_the_queue_gets_429_with_retry_after() -> None:
    outcome = asyncio.run(share_outcome())
    third, many = outcome["third"], outcome["many"]
    assert third.status_code == 429 and third.headers["Retry-After"] == "1"
    assert third.json()["error"] == {
        "message": "this client holds 2 engine requests; 1 more would pass its share of 2 "
        "(server.client_share of max_queue)",
        "type": "rate_limit_error",
        "param": None,
        "code": "client_share_exceeded",
    }
    assert many.status_code == 400
    assert many.json()["error"]["message"] == (
        "prompt: 3 prompt(s) x n=1 make 3 engine requests, more than the 2 this server admits "
        "at once for one client (server.client_share)"
    )
    assert sorted(outcome["held"].values()) == [1, 2]
