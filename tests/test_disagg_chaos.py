"""Chaos: 2 prefill + 2 decode workers serve 120 streamed greedy requests (8 tokens each, the
first of each of the 16 clients 64) while decode-0 (with requests running) and then prefill-0
(half the requests done) are killed with SIGKILL. Every request completes with the offline
engine's greedy text, the requests on decode-0 migrated, and both workers are back in their
pools (restarted by Ray). `make chaos` runs the same with 32 tokens per request
(tests/support/chaos.py) and prints the recovery times. Scaled down to one worker of each
role, 100 requests wait for the restarted workers and all complete the same."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from splitserve.engine.llm import LLM
from tests.support.chaos import SERVER_SETTINGS, Chaos, prompts, reference, summary
from tests.support.server_process import ServerProcess, serve, worker_metric

pytestmark = pytest.mark.slow
REQUESTS = 120  # `make chaos`: 200
REQUESTS_1P1D = 100
MAX_TOKENS = 8
CONCURRENCY = 16


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """One deployment for both tests: 2P2D, then scaled down to 1P1D by the second."""
    with serve(*SERVER_SETTINGS) as process:
        yield process


@pytest.fixture(scope="module")
def expected(smollm2_llm: LLM) -> list[str]:
    """The offline engine's texts for both tests, computed once: the 1P1D test's prompts are
    the first REQUESTS_1P1D of these (``prompts``), sent the same way (the first CONCURRENCY
    with OPENING_TOKENS), so their texts are the first REQUESTS_1P1D."""
    assert REQUESTS_1P1D <= REQUESTS and prompts(REQUESTS)[:REQUESTS_1P1D] == prompts(REQUESTS_1P1D)
    return reference(smollm2_llm, prompts(REQUESTS), MAX_TOKENS, CONCURRENCY)


def test_killed_decode_and_prefill_workers_lose_no_request_and_come_back(
    server: ServerProcess, expected: list[str]
) -> None:
    texts = prompts(REQUESTS)
    chaos = Chaos(server, texts, MAX_TOKENS, CONCURRENCY)
    chaos.run()
    migrated = worker_metric(server.url, "splitserve:request_migrations_total", "decode-0")
    restarts = {
        worker: worker_metric(server.url, "splitserve:worker_restarts_total", worker)
        for worker in ("decode-0", "prefill-0")
    }
    assert [o.error for o in chaos.outcomes] == [None] * REQUESTS
    assert [o.text for o in chaos.outcomes] == expected
    assert [k.worker for k in chaos.kills] == ["decode-0", "prefill-0"]
    assert migrated >= 1
    assert restarts == {"decode-0": 1.0, "prefill-0": 1.0}
    print(summary(chaos))


def test_with_one_worker_per_role_a_kill_holds_the_requests_until_the_restart(
    server: ServerProcess, expected: list[str]
) -> None:
    """Before: with one decode worker, its kill failed every request in flight with a 503
    (85 of 100), though the supervisor had it back in about 5 s."""
    texts = prompts(REQUESTS_1P1D)
    scaled = httpx.post(
        f"{server.url}/admin/scale", json={"replicas": {"prefill": 1, "decode": 1}}, timeout=60
    )
    assert scaled.status_code == 200, scaled.text
    # Scaling down keeps the oldest member of each pool: a worker restarted by the test above
    # joined its pool again after the other.
    [prefill], [decode] = (scaled.json()["pools"][p]["workers"] for p in ("prefill", "decode"))
    health = httpx.get(f"{server.url}/health").json()["pools"]
    assert [health[pool]["ready"] for pool in ("prefill", "decode")] == [1, 1]
    chaos = Chaos(server, texts, MAX_TOKENS, CONCURRENCY, replicas=1, victims=(decode, prefill))
    chaos.run()
    assert [o.error for o in chaos.outcomes] == [None] * REQUESTS_1P1D
    assert [o.text for o in chaos.outcomes] == expected[:REQUESTS_1P1D]
    assert [k.worker for k in chaos.kills] == [decode, prefill]
    print(summary(chaos))
