"""Who may call /admin (scaling): an admin key where admin keys are configured, else only a
loopback client (with the API key when API keys are configured). An API key alone never
resizes a deployment from elsewhere. In-process: the admin routes on a bare FastAPI app."""

from __future__ import annotations

from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from splitserve.server_config import ServerConfig
from splitserve.services.api import admin
from splitserve.services.api.errors import install_error_handlers

POOLS = {"decode": {"role": "decode", "workers": ["decode-0"]}}


class Scaler:
    def pools(self) -> dict[str, dict[str, Any]]:
        return POOLS

    async def scale(self, replicas: Mapping[str, int]) -> dict[str, dict[str, Any]]:
        return POOLS


def client(server: ServerConfig, host: str) -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin.router)
    app.state.server = SimpleNamespace(config=SimpleNamespace(server=server))
    app.state.scaler = Scaler()
    return TestClient(app, client=(host, 50000))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.mark.parametrize(
    ("server", "host", "headers", "status"),
    [
        (ServerConfig(), "127.0.0.1", {}, 200),
        (ServerConfig(), "10.1.2.3", {}, 403),
        (ServerConfig(api_keys=("user",)), "127.0.0.1", bearer("user"), 200),
        (ServerConfig(api_keys=("user",)), "127.0.0.1", {}, 401),
        (ServerConfig(api_keys=("user",)), "10.1.2.3", bearer("user"), 403),
        (ServerConfig(api_keys=("user",), admin_keys=("ops",)), "10.1.2.3", bearer("ops"), 200),
        (ServerConfig(api_keys=("user",), admin_keys=("ops",)), "10.1.2.3", bearer("user"), 403),
        (ServerConfig(api_keys=("user",), admin_keys=("ops",)), "127.0.0.1", bearer("user"), 403),
        (ServerConfig(admin_keys=("ops",)), "127.0.0.1", {}, 403),
        (ServerConfig(admin_keys=("ops",)), "10.1.2.3", bearer("opsx"), 403),
    ],
)
def test_who_may_scale(
    server: ServerConfig, host: str, headers: dict[str, str], status: int
) -> None:
    with client(server, host) as test_client:
        for response in (
            test_client.get("/admin/pools", headers=headers),
            test_client.post("/admin/scale", json={"replicas": {"decode": 2}}, headers=headers),
        ):
            assert response.status_code == status, response.text
            if status == 200:
                assert response.json() == {"pools": POOLS}
            else:
                error = response.json()["error"]
                assert error["code"] in ("forbidden", "invalid_api_key")
                if status == 403:
                    assert "admin key" in error["message"]


def test_an_empty_admin_key_is_a_config_error() -> None:
    with pytest.raises(ValueError, match=r"server\.admin_keys must not contain empty keys"):
        ServerConfig(admin_keys=("",))


@pytest.mark.parametrize(
    ("server", "headers", "status"),
    [
        (ServerConfig(host="0.0.0.0"), {}, 403),
        (ServerConfig(host="10.1.2.3", api_keys=("user",)), bearer("user"), 403),
        (ServerConfig(host="0.0.0.0", admin_keys=("ops",)), bearer("ops"), 200),
    ],
)
def test_a_server_bound_beyond_loopback_needs_an_admin_key_even_from_loopback(
    server: ServerConfig, headers: dict[str, str], status: int
) -> None:
    """Behind a proxy on the server's host every client is loopback (issue 48)."""
    with client(server, "127.0.0.1") as test_client:
        response = test_client.get("/admin/pools", headers=headers)
    assert response.status_code == status, response.text
    if status == 403:
        assert response.json()["error"]["message"] == (
            f"admin routes need an admin key (server.admin_keys): the server is bound to "
            f"{server.host}, not loopback"
        )


@pytest.mark.parametrize("count", [-1, 65, 10**9])
def test_scaling_is_bounded_by_max_replicas(count: int) -> None:
    with client(ServerConfig(), "127.0.0.1") as test_client:
        response = test_client.post("/admin/scale", json={"replicas": {"decode": count}})
    assert response.status_code == 400
    assert response.json()["error"] == {
        "message": f"replicas.decode: {count} is outside [0, 64] (server.max_replicas)",
        "type": "invalid_request_error",
        "param": "replicas.decode",
        "code": "invalid_value",
    }
