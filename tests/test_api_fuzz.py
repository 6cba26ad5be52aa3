"""The OpenAI endpoints fuzzed from the server's own OpenAPI schema (schemathesis, issue 16)
against the suite's shared default deployment: no answer is a 5xx, no worker fails or
restarts, and the server serves a normal request after.

The suite runs FUZZ_CASES positive and as many negative cases per endpoint, the same ones
each run (derandomized); ``make fuzz`` runs 250 of each (1,000 in all), random each time.
"""

from __future__ import annotations

import os

import httpx

from tests.support.api_fuzz import fuzz
from tests.support.server_process import ServerProcess, worker_pids

MODEL = "smollm2-135m-instruct"
SUITE_CASES = 15
FUZZ_CASES = int(os.environ.get("SPLITSERVE_FUZZ_CASES", SUITE_CASES))
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
LOST = ('reason="worker_failed"', 'reason="worker_lost"', 'reason="internal_error"')


def health(server: ServerProcess) -> tuple[int, object]:
    response = httpx.get(f"{server.url}/health")
    return response.status_code, response.json()


def lost_requests(server: ServerProcess) -> float:
    """Requests that failed because a worker failed or went silent, or the API server failed
    handling their output (splitserve:request_failure_total by reason)."""
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line.startswith("splitserve:request_failure_total{") and any(r in line for r in LOST)
    )


def test_fuzzed_requests_get_no_5xx_and_the_server_serves_after(
    default_server: ServerProcess,
) -> None:
    before, lost = health(default_server), lost_requests(default_server)
    pids = worker_pids(default_server)
    report = fuzz(default_server.url, MODEL, FUZZ_CASES, derandomize=FUZZ_CASES == SUITE_CASES)
    assert report.server_errors == []
    assert report.cases >= 4 * FUZZ_CASES and report.statuses[200] > 0
    assert health(default_server) == before and before[0] == 200
    assert worker_pids(default_server) == pids and lost_requests(default_server) == lost
    answer = httpx.post(f"{default_server.api}/chat/completions", json=CHAT, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2
