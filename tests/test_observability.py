"""A real Prometheus scrapes a real splitserve under load; every dashboard query has data.

With SPLITSERVE_DASHBOARD_PNG=<path> the load runs longer (with a live scale to 2P2D and back
in the middle) and the dashboard is rendered to that PNG (docs/img/dashboard.png).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from benchmarks.render_dashboard import dashboard_exprs, render
from tests.support.load import MODEL, Load
from tests.support.prometheus_process import prometheus, prometheus_binary, query
from tests.support.server_process import ServerProcess, serve
from tests.support.wait import wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        prometheus_binary() is None,
        reason="the prometheus binary is absent (make install installs Debian's prometheus)",
    ),
]
PNG = os.environ.get("SPLITSERVE_DASHBOARD_PNG")


def abort_one_stream(server: ServerProcess) -> None:
    """A client that goes away mid-stream: a request_failure_total{reason="abort"}."""
    body = {"model": MODEL, "prompt": "Tell a long story:", "max_tokens": 200, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                break


def empty_panels(url: str) -> list[str]:
    """The dashboard queries that return no data now."""
    return [f"{title}: {expr}" for title, expr, _ in dashboard_exprs() if not query(url, expr)]


def scale(server: ServerProcess, prefill: int, decode: int) -> None:
    replicas = {"prefill": prefill, "decode": decode}
    response = httpx.post(f"{server.url}/admin/scale", json={"replicas": replicas}, timeout=300)
    assert response.status_code == 200, response.text


def run_load(server: ServerProcess) -> None:
    if PNG is None:
        with Load(server.url, concurrency=4, max_tokens=16) as load:
            load.wait_finished(12)
        assert load.failures == []
        return
    for concurrency, seconds, after in ((2, 40, (2, 2)), (8, 60, (1, 1)), (4, 40, None)):
        with Load(server.url, concurrency=concurrency, max_tokens=24) as load:
            time.sleep(seconds)  # how long the dashboard shows this phase of the load
            if after is not None:
                scale(server, *after)
        assert load.failures == []


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest) -> Iterator[ServerProcess]:
    """The shared default deployment; the longer PNG run scales it, so it starts its own."""
    if PNG is None:
        yield request.getfixturevalue("default_server")
        return
    with serve() as process:
        yield process


def test_every_dashboard_query_returns_data_from_a_real_prometheus(server: ServerProcess) -> None:
    with prometheus(server.url.removeprefix("http://")) as prom:
        start = time.time()
        run_load(server)
        # A light load goes on while the panels are read: their rate() windows (30 s) must
        # see traffic, however fast the main load went.
        with Load(server.url, concurrency=1, max_tokens=8) as background:
            abort_one_stream(server)
            aborts = 'splitserve:request_failure_total{reason="abort"}'
            wait_for(lambda: query(prom, aborts), 30, interval=0.5, message=f"a series {aborts}")
            # Scrapes come every second, and a rate needs two of them.
            wait_for(
                lambda: not empty_panels(prom),
                60,
                interval=1.0,
                message=lambda: f"data in every dashboard panel; without: {empty_panels(prom)}",
            )
        assert background.failures == []
        pools = {s["metric"]["pool"] for s in query(prom, "splitserve:num_workers")}
        assert pools == {"prefill", "decode"}
        ttft = query(prom, "splitserve:time_to_first_token_seconds_count")
        assert {s["metric"]["worker"] for s in ttft} >= {"prefill-0"}
        if PNG is not None:
            render(prom, start, time.time(), Path(PNG))
