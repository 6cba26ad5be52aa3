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

from splitserve.config import DeployConfig
from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.redis_index import RedisPrefixIndex
from splitserve.services.api.chat import render_chat
from splitserve.services.api.protocol import ChatMessage
from tests.support.api_harness import MODEL, ONE_PAIR, ROOT, answer_at_once, api_over_fake_workers
from tests.support.redis_process import RedisProcess

TEXT = "Tell me about the sea. " * 8
"""Long enough for several blocks of 16 tokens."""


async def serve_over_malformed_entries(tokenizer: Any, url: str) -> dict[str, Any]:
    namespace = f"test:{uuid.uuid4().hex}"
    prompt = render_chat(tokenizer, [ChatMessage(role="user", content=TEXT)])
    keys = [f"{namespace}:b:{h:016x}" for h in block_hashes(prompt, 16, ROOT)]
    client = redis.Redis.from_url(url)
    for key in keys:  # issue 48's HSET splitserve:kv:b:<hash> x@device notafloat
        client.hset(key, "prefill-0@device", "notafloat")
    index = RedisPrefixIndex(url, ttl_s=60.0, namespace=namespace)
    async with api_over_fake_workers(
        DeployConfig(), tokenizer, ONE_PAIR, index, answer_at_once, ROOT
    ) as api:
        results = [await send(api.http) for _ in range(3)]
    return {
        "results": results,
        "blocks": len(keys),
        "malformed": api.counter("prefix_index_malformed"),
        "timeouts": api.counter("prefix_lookup_timeouts"),
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
