"""Malformed data in a real Redis prefix index under the API server (issue 48): the real app,
request exchange and index in this process, the workers ZMQ sockets of the test. A value that
is not a time on every block of the prompt made each such request a 500; now they are
skipped, counted in splitserve:prefix_index_malformed_total, and the requests are routed by
load."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from typing import Any

import httpx
import redis
import zmq.asyncio

from splitserve.config import DeployConfig
from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.redis_index import RedisPrefixIndex
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import Router
from splitserve.services.api.app import build_app
from splitserve.services.api.chat import render_chat
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.protocol import ChatMessage
from splitserve.services.api.serving import ServerState
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.metrics import Metrics
from tests.support.fake_worker import SEALER, FakeWorker
from tests.support.redis_process import RedisProcess
from tests.support.wait import wait_for_async
from tests.test_api_hung_redis import MODEL, ROOT, answer

TEXT = "Tell me about the sea. " * 8
"""Long enough for several blocks of 16 tokens."""


async def serve_over_malformed_entries(tokenizer: Any, url: str) -> dict[str, Any]:
    namespace = f"test:{uuid.uuid4().hex}"
    prompt = render_chat(tokenizer, [ChatMessage(role="user", content=TEXT)])
    keys = [f"{namespace}:b:{h:016x}" for h in block_hashes(prompt, 16, ROOT)]
    client = redis.Redis.from_url(url)
    for key in keys:  # issue 48's HSET splitserve:kv:b:<hash> x@device notafloat
        client.hset(key, "prefill-0@device", "notafloat")
    ctx = zmq.asyncio.Context()
    roles = {"prefill-0": "prefill", "decode-0": "decode"}
    workers = {worker_id: FakeWorker(ctx, worker_id, role) for worker_id, role in roles.items()}
    metrics = Metrics(MODEL)
    pool = WorkerPool([w.endpoint for w in workers.values()], metrics, SEALER, 60.0)
    index = RedisPrefixIndex(url, ttl_s=60.0, namespace=namespace)
    router = Router("cache_aware", "cache_aware")
    exchange = RequestExchange(pool, 64, metrics, router, 16, PrefixLookup(index, 16))
    exchange.start()
    state = ServerState(DeployConfig(), tokenizer, exchange, metrics, 2048)
    task = asyncio.create_task(answer(workers["prefill-0"], workers["decode-0"]))
    try:
        for worker in workers.values():
            await worker.heartbeat(hash_root=ROOT)
        await wait_for_async(lambda: pool.ready, 5.0, message="both workers reported in")
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            results = [await send(http) for _ in range(3)]
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await exchange.close()
        ctx.destroy(linger=0)
    labels = {"model_name": MODEL, "pool": "api", "worker": "api"}
    return {
        "results": results,
        "blocks": len(keys),
        "malformed": metrics.registry.get_sample_value(
            "splitserve:prefix_index_malformed_total", labels
        ),
        "timeouts": metrics.registry.get_sample_value(
            "splitserve:prefix_lookup_timeouts_total", labels
        ),
    }


async def send(http: httpx.AsyncClient) -> tuple[int, str]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": TEXT}], "max_tokens": 1}
    response = await http.post("/v1/chat/completions", json=body)
    return response.status_code, response.json()["choices"][0]["finish_reason"]


def test_malformed_index_entries_are_skipped_counted_and_routed_by_load(
    smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    server = RedisProcess(tmp_path)
    server.start()
    try:
        outcome = asyncio.run(serve_over_malformed_entries(smollm2_tokenizer, server.url))
    finally:
        server.stop()
    assert outcome["results"] == [(200, "stop")] * 3
    assert outcome["blocks"] >= 4
    # Each lookup meets block 0's bad value and stops there (nothing is cached from it on).
    assert outcome["malformed"] == 3
    assert not outcome["timeouts"]  # answered (None: the counter was never touched)
