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
import zmq.asyncio

from splitserve.config import DeployConfig
from splitserve.kvstore.hashing import hash_root
from splitserve.kvstore.redis_index import RedisPrefixIndex
from splitserve.router.prefix_lookup import WAIT_S, PrefixLookup
from splitserve.router.router import Router
from splitserve.services import messages as msg
from splitserve.services.api.app import build_app
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.serving import ServerState
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.metrics import Metrics
from tests.support.fake_worker import SEALER, FakeWorker, delta
from tests.support.fake_worker import gate as fake_gate
from tests.support.hung_listener import hung_listener
from tests.support.wait import wait_for_async

MODEL = "smollm2-135m-instruct"
ROOT = hash_root(MODEL, "float32", 16)
REQUESTS = 24
SPACING_S = 0.1
"""24 requests 0.1 s apart: the index's 1 s retry interval passes twice, so the hung Redis is
asked (and waited on, up to its 0.25 s socket timeout) again during the run."""


async def answer(prefill: FakeWorker, decode: FakeWorker) -> None:
    """The workers' side, at once: Reserved for each Reserve, one token for each Prefill."""

    async def decode_side() -> None:
        while True:
            reserve = SEALER.unseal(await decode.requests.recv())
            if isinstance(reserve, msg.Reserve):
                await decode.send(msg.Reserved(reserve.request_id))

    async def prefill_side() -> None:
        while True:
            computed = SEALER.unseal(await prefill.requests.recv())
            if isinstance(computed, msg.Prefill):
                await prefill.send(delta(computed.request_id, [42], "stop"))

    await asyncio.gather(decode_side(), prefill_side())


async def loop_stalls(stalls: list[float]) -> None:
    """How late each 10 ms sleep of the event loop wakes up."""
    while True:
        start = time.monotonic()
        await asyncio.sleep(0.01)
        stalls.append(time.monotonic() - start - 0.01)


async def serve_through_a_hung_redis(tokenizer: Any, port: int) -> dict[str, Any]:
    ctx = zmq.asyncio.Context()
    gate = fake_gate(ctx)
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    workers = {worker_id: FakeWorker(ctx, worker_id, role) for worker_id, role in roles.items()}
    metrics = Metrics(MODEL)
    pool = WorkerPool([w.endpoint for w in workers.values()], metrics, SEALER, 60.0)
    index = RedisPrefixIndex(f"redis://127.0.0.1:{port}/0", ttl_s=60.0)
    router = Router("cache_aware", "cache_aware")
    exchange = RequestExchange(pool, 64, metrics, router, 16, PrefixLookup(index, 16))
    exchange.start()
    state = ServerState(DeployConfig(), tokenizer, exchange, metrics, 2048)
    tasks = [asyncio.create_task(answer(workers["prefill-0"], workers["decode-0"]))]
    stalls: list[float] = []
    try:
        for worker in workers.values():
            await worker.heartbeat(hash_root=ROOT)
        await wait_for_async(lambda: pool.ready, 5.0, message="both workers reported in")
        tasks.append(asyncio.create_task(loop_stalls(stalls)))
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
            results = await asyncio.gather(
                *(send_one(client, i * SPACING_S) for i in range(REQUESTS))
            )
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await exchange.close()
        gate.stop()
        ctx.destroy(linger=0)
    timeouts = metrics.registry.get_sample_value(
        "splitserve:prefix_lookup_timeouts_total",
        {"model_name": MODEL, "pool": "api", "worker": "api"},
    )
    return {"results": results, "max_stall": max(stalls), "timeouts": timeouts}


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
