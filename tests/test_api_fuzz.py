"""Every endpoint fuzzed from the server's own OpenAPI schema (schemathesis, issues 16 and
48) against the suite's shared default deployment, with hostile bodies among them (a lone
surrogate in a string, 500-970 levels of nesting: tests/support/api_fuzz.py): no answer is a
5xx, no worker fails or restarts, and the server serves a normal request after.

The suite runs FUZZ_CASES positive cases per endpoint and as many negative ones for the 3
that take a body, the same ones each run (derandomized); ``make fuzz`` runs 100 of each
(1,000 in all), random each time.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest

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
    crashes = [
        line for line in default_server.lines if "unhandled error" in line or "Error" in line
    ]
    assert report.server_errors == [], "\n".join(report.server_errors + crashes)
    assert report.cases >= 4 * FUZZ_CASES and report.statuses[200] > 0
    assert health(default_server) == before and before[0] == 200
    assert worker_pids(default_server) == pids and lost_requests(default_server) == lost
    answer = httpx.post(f"{default_server.api}/chat/completions", json=CHAT, timeout=60)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 2


def strict_json(text: str) -> Any:
    """JSON as the standard has it: no NaN or Infinity (Python's parser takes them)."""

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def bodies(response: httpx.Response, stream: bool) -> list[Any]:
    if not stream:
        return [strict_json(response.text)]
    events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
    return [strict_json(event) for event in events if event != "[DONE]"]


def logprob_values(body: Any) -> list[float]:
    """Every logprob in a chat or completions answer (or chunk)."""
    values: list[float] = []
    for choice in body.get("choices", []):
        found = choice.get("logprobs") or {}
        for item in found.get("content") or []:  # chat
            values += [item["logprob"]] + [t["logprob"] for t in item["top_logprobs"]]
        values += found.get("token_logprobs") or []  # completions
        for top in found.get("top_logprobs") or []:
            values += list(top.values())
    return values


LOGPROB_CASES = {
    "completions": {"prompt": "Answer:", "logprobs": 5},
    "chat": {
        "messages": [{"role": "user", "content": "Say yes"}],
        "logprobs": True,
        "top_logprobs": 5,
    },
}


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_logprobs_of_tokens_a_grammar_masks_are_finite_json(
    default_server: ServerProcess, endpoint: str, stream: bool
) -> None:
    """Found by the fuzzer: the alternatives a constraint masks have logprob -inf, which made a
    full answer a 500 and a stream send `-Infinity` (not JSON); they are -9999.0 now."""
    path = "chat/completions" if endpoint == "chat" else "completions"
    body = {
        "model": MODEL,
        "max_tokens": 1,
        "temperature": 0.0,
        "structured_outputs": {"choice": ["yes"]},
        "stream": stream,
        **LOGPROB_CASES[endpoint],
    }
    response = httpx.post(f"{default_server.api}/{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    values = [v for answer in bodies(response, stream) for v in logprob_values(answer)]
    assert len(values) == 6  # the sampled token's, then its position's top 5
    assert values.count(-9999.0) >= 1 and all(-9999.0 <= v <= 0.0 for v in values)
