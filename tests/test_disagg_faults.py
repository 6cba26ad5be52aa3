"""A prefill worker killed mid-request: the clients get errors, the decode worker its blocks."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.support.disagg import MODEL
from tests.support.server_process import ServerProcess, serve, worker_metric, worker_pids
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
TIMEOUT_S = 8.0
SEND_DELAY_S = 3.0
HEARTBEAT_S = 5.0
FREE = "splitserve:kv_cache_free_blocks"
TOTAL = "splitserve:kv_cache_total_blocks"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve(
        f"transfer.timeout_s={TIMEOUT_S}",
        f"transfer.fault_send_delay_s={SEND_DELAY_S}",  # a window to kill the sender in
        f"server.heartbeat_timeout_s={HEARTBEAT_S}",
        # Fail at once instead of waiting for the restarted prefill worker (the wait:
        # tests/test_disagg_chaos.py, 1P1D).
        "server.restart_wait_s=0",
    ) as process:
        yield process


def body(stream: bool, first: int) -> dict[str, object]:
    """A 200-token prompt of its own (no prefix shared with the other requests)."""
    prompt = [first + i for i in range(200)]
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": stream}


def streamed_events(url: str) -> list[dict[str, object]]:
    events = []
    with httpx.stream(
        "POST", f"{url}/v1/completions", json=body(True, 3000), timeout=60
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[len("data: ") :]))
            elif line == "data: [DONE]":
                events.append({"done": True})
    return events


def decode_total_blocks(server: ServerProcess) -> float:
    return worker_metric(server.url, TOTAL, "decode-0")


def test_killing_the_prefill_worker_fails_its_requests_and_frees_reserved_blocks(
    server: ServerProcess,
) -> None:
    warm = httpx.post(f"{server.url}/v1/completions", json=body(False, 1000), timeout=60)
    assert warm.status_code == 200  # the prefill -> decode channel exists now
    wait_for(
        lambda: worker_metric(server.url, FREE, "decode-0") == decode_total_blocks(server) > 0,
        10,
        message="the warm-up request's blocks free again on decode-0",
    )
    free_before = worker_metric(server.url, FREE, "decode-0")
    results: dict[str, object] = {}
    threads = [
        threading.Thread(
            target=lambda: results.update(
                full=httpx.post(f"{server.url}/v1/completions", json=body(False, 2000), timeout=60)
            )
        ),
        threading.Thread(target=lambda: results.update(streamed=streamed_events(server.url))),
    ]
    for thread in threads:
        thread.start()
    wait_for(
        lambda: worker_metric(server.url, FREE, "decode-0") < free_before,
        20,
        message="the decode worker's blocks reserved for both requests",
    )
    # The kill lands inside the send delay: the prefill worker holds the computed KV and
    # has not sent it, the window this test is about (no condition marks it from outside).
    time.sleep(SEND_DELAY_S / 2)
    os.kill(worker_pids(server)["prefill-0"], signal.SIGKILL)
    killed = time.monotonic()
    for thread in threads:
        thread.join(timeout=TIMEOUT_S + HEARTBEAT_S + 10)
    assert time.monotonic() - killed < TIMEOUT_S + 2

    full = results["full"]
    assert isinstance(full, httpx.Response) and full.status_code == 503
    assert full.json()["error"]["code"] == "request_failed"
    streamed = results["streamed"]
    assert isinstance(streamed, list)
    assert "error" in streamed[-2] and streamed[-1] == {"done": True}

    wait_for(
        lambda: worker_metric(server.url, FREE, "decode-0") == free_before,
        10,
        message="the decode worker's reserved blocks free again",
    )
    wait_for(
        lambda: httpx.get(f"{server.url}/health").status_code == 503,
        HEARTBEAT_S + 5,
        message="/health 503 once the killed worker's heartbeat is overdue",
    )
    pools = httpx.get(f"{server.url}/health").json()["pools"]
    assert pools["prefill"] == {"status": "unavailable", "replicas": 1, "ready": 0}
    assert pools["decode"] == {"status": "ok", "replicas": 1, "ready": 1}
