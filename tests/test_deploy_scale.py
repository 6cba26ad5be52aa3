"""`splitserve scale` against a running 1P1D server under load: no request fails. The server is
the suite's shared default deployment, scaled up and back to 1P1D by its last user
(tests/conftest.py: SCALES_SHARED); the request log is read from this test's first line on."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import httpx
import pytest

from tests.support.load import Load
from tests.support.server_process import REPO, ServerProcess
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow


def scale(server: ServerProcess, *args: str) -> str:
    command = [sys.executable, "-m", "splitserve.cli", "scale", "--base-url", server.url]
    done = subprocess.run([*command, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout


def pools(server: ServerProcess) -> dict[str, list[str]]:
    body = httpx.get(f"{server.url}/admin/pools").json()
    return {name: pool["workers"] for name, pool in body["pools"].items()}


def request_log(server: ServerProcess, first: int) -> list[dict[str, Any]]:
    """The finished requests' lines from the server's line ``first`` on (refused requests,
    logged as ``{"refused": ...}``, left out)."""
    prefix = "splitserve request "
    lines = [
        json.loads(line[len(prefix) :]) for line in server.lines[first:] if line.startswith(prefix)
    ]
    return [e for e in lines if "refused" not in e]


def workers_served(server: ServerProcess, first: int) -> tuple[set[str], set[str]]:
    """The prefill and the decode workers that the request log names from line ``first``."""
    log = request_log(server, first)
    return {e["prefill_worker"] for e in log}, {e["decode_worker"] for e in log}


def test_scale_prefill_and_decode_up_and_down_under_load_loses_no_request(
    default_server: ServerProcess,
) -> None:
    server, first = default_server, len(default_server.lines)
    with Load(server.url) as load:
        bad = httpx.post(f"{server.url}/admin/scale", json={"replicas": {"vision": 1}})
        assert bad.status_code == 400
        assert "no pool or role named 'vision'" in bad.json()["error"]["message"]
        zero = httpx.post(f"{server.url}/admin/scale", json={"replicas": {"decode": 0}})
        assert zero.status_code == 400
        load.wait_finished(8)
        out = scale(server, "--prefill", "2", "--decode", "2")
        assert out == (
            'prefill (prefill): 2 ["prefill-0", "prefill-1"]\n'
            'decode (decode): 2 ["decode-0", "decode-1"]\n'
        )
        # Until the new workers have served: every prefill and decode worker of the 2P2D
        # deployment appears in the request log (all of them finished with "length").
        wait_for(
            lambda: (
                workers_served(server, first)
                == ({"prefill-0", "prefill-1"}, {"decode-0", "decode-1"})
            ),
            120,
            interval=0.2,
            message=lambda: f"both new workers serving: {workers_served(server, first)}",
        )
        out = scale(server, "--prefill", "1", "--decode", "1")
        assert pools(server) == {"prefill": ["prefill-0"], "decode": ["decode-0"]}
        before = len(load.finished)
        load.wait_finished(8)
        late = request_log(server, first)[-4:]
        assert {(e["prefill_worker"], e["decode_worker"]) for e in late} == {
            ("prefill-0", "decode-0")
        }
        health = httpx.get(f"{server.url}/health").json()
        assert health["pools"]["prefill"]["replicas"] == 1
        assert health["pools"]["decode"]["replicas"] == 1
    assert load.failures == []
    assert len(load.finished) > before
    assert set(load.finished) == {"length"}
    # The server runs on: its line for a request may follow the request's last event.
    wait_for(
        lambda: len(request_log(server, first)) >= len(load.finished),
        10,
        message="a request log line for every finished stream",
    )
    entries = request_log(server, first)
    assert len(entries) == len(load.finished)
    assert all(e["status"] == "ok" and e["generation_tokens"] == 12 for e in entries)
    assert all(e["ttft_s"] is not None and e["prompt_tokens"] > 0 for e in entries)
