"""A hung Redis (a listener that accepts and never answers) under the API server (issue 16):
the real app, request exchange and Redis prefix index in this process, with a prefill and a
decode worker that are ZMQ sockets of the test answering at once. Requests keep flowing, each
at most the lookup's wait slower, and the event loop that streams every other request's tokens
never stalls on the index."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from splitserve.config import DeployConfig
from splitserve.kvstore.redis_index import RedisPrefixIndex
from splitserve.router.prefix_lookup import WAIT_S
from tests.support.api_harness import MODEL, ONE_PAIR, ROOT, answer_at_once, api_over_fake_workers
from tests.support.hung_listener import hung_listener

REQUESTS = 24
SPACING_S = 0.1
"""24 requests 0.1 s apart: the index's 1 s retry interval passes twice, so the hung Redis is
asked (and waited on, up to its 0.25 s socket timeout) again during the run."""


async def loop_stalls(stalls: list[float]) -> None:
    """How late each 10 ms sleep of the event loop wakes up."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.01)
        stalls.append(time.monotonic() - start - 0.01)


async def serve_through_a_hung_redis(tokenizer: Any, port: int) -> dict[str, Any]:
    index = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", ttl_s=60.0)
    stalls: list[float] = []
    async with api_over_fake_workers(
        DeployConfig(), tokenizer, ONE_PAIR, index, answer_at_once, ROOT
    ) as api:
        stalling = asyncio.create_task(loop_stalls(stalls))
        try:
            results = await asyncio.gather(
                *(send_one(api.http, i * SPACING_S) for i in range(REQUESTS))
            )
        finally:
            stalling.cancel()
            await asyncio.gather(stalling, return_exceptions=True)
    return {
        "results": results,
        "max_stall": max(stalls),
        "timeouts": api.counter("prefix_lookup_timeouts"),
    }


async def send_one(client: httpx.AsyncClient, delay_s: float) -> tuple[int, str, float]:
    await asyncio.sleep(delay_s)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    start = time.monotonic()
    response = await client.post("/v1/chat/completions", json=body)
    return (
        response.status_code,
        response.json()["choices"][0]["finish_reason"],
        (time.monotonic() - start),
    )


def test_requests_keep_flowing_over_a_hung_redis_and_the_loop_never_stalls(
    smollm2_tokenizer: Any,
) -> None:
    """Before: the prefix lookup ran on the event loop, which stopped for the Redis socket
    timeout (0.25 s) at every retry, holding up every request and every stream."""
    with hung_listener() as (port, accepted):
        outcome = asyncio.run(serve_through_a_hung_redis(smollm2_tokenizer, port))
        assert accepted, "the index did reach the hung listener"
    results = outcome["results"]
    assert [(status, finish) for status, finish, _ in results] == [(200, "stop")] * REQUESTS
    assert max(seconds for _, _, seconds in results) < WAIT_S + 0.15
    assert outcome["max_stall"] < 0.1
    assert outcome["timeouts"] is not None and outcome["timeouts"] >= 2
