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

from splitserve.config import ServerConfig
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
