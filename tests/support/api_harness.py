"""The real API app, request exchange and router in the test's event loop, over workers that
are ZMQ sockets of the test (fake_worker.py): for tests of what the API server does with
what its workers and its prefix index answer, without starting any process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import zmq.asyncio

from splitserve.config import DeployConfig
from splitserve.kvstore.hashing import hash_root
from splitserve.kvstore.index import PrefixIndex
from splitserve.router.prefix_lookup import PrefixLookup
from splitserve.router.router import Router
from splitserve.services import messages as msg
from splitserve.services.api.app import build_app
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.serving import ServerState
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.metrics import Metrics
from tests.support.fake_worker import SEALER, FakeWorker, delta
from tests.support.fake_worker import gate as fake_gate
from tests.support.wait import wait_for_async

MODEL = "smollm2-135m-instruct"
ROOT = hash_root(MODEL, "float32", 16)
"""The hash root of SmolLM2's float32 workers: block hashes the router asks the index for."""
ONE_PAIR = {"prefill-0": "prefill", "decode-0": "decode"}


async def answer_at_once(workers: dict[str, FakeWorker]) -> None:
    """ONE_PAIR's side, at once: Reserved for each Reserve, one token for each Prefill."""
    prefill, decode = workers["prefill-0"], workers["decode-0"]

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


@dataclass
class Harness:
    http: httpx.AsyncClient
    """Talks to the app in-process."""
    state: ServerState
    workers: dict[str, FakeWorker]

    @property
    def metrics(self) -> Metrics:
        return self.state.metrics

    @property
    def exchange(self) -> RequestExchange:
        return self.state.exchange

    def counter(self, name: str) -> float | None:
        """The API server's own sample of a splitserve counter (None: never counted)."""
        labels = {"model_name": MODEL, "pool": "api", "worker": "api"}
        return self.metrics.registry.get_sample_value(f"splitserve:{name}_total", labels)


@asynccontextmanager
async def api_over_fake_workers(
    config: DeployConfig,
    tokenizer: Any,
    roles: dict[str, str],
    index: PrefixIndex | None = None,
    answer: Callable[[dict[str, FakeWorker]], Awaitable[None]] | None = None,
    hash_root: int = 0,
) -> AsyncIterator[Harness]:
    """roles: worker id -> role; index: the prefix index routing asks (cache-aware routing);
    answer: the workers' side, run as a task until the block ends. Every worker has sent a
    heartbeat (with hash_root) when the block starts."""
    ctx = zmq.asyncio.Context()
    gate = fake_gate(ctx)
    workers = {worker_id: FakeWorker(ctx, worker_id, role) for worker_id, role in roles.items()}
    metrics = Metrics(MODEL)
    pool = WorkerPool([w.endpoint for w in workers.values()], metrics, SEALER, 60.0)
    router = Router("cache_aware", "cache_aware") if index is not None else Router()
    prefix = PrefixLookup(index, 16) if index is not None else None
    exchange = RequestExchange(pool, config.server.max_queue, metrics, router, 16, prefix)
    exchange.start()
    state = ServerState(config, tokenizer, exchange, metrics, 2048)
    tasks = [asyncio.create_task(answer(workers))] if answer is not None else []
    try:
        for worker in workers.values():
            await worker.heartbeat(hash_root=hash_root)
        await wait_for_async(lambda: pool.ready, 5.0, message="the workers reported in")
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as http:
            yield Harness(http, state, workers)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await exchange.close()
        gate.stop()
        ctx.destroy(linger=0)
