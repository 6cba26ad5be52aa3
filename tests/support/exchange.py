"""The API server's request exchange (services/api/exchange.py) in-process, against workers
that are real ZMQ sockets in the test (FakeWorker): the test plays every worker, its messages
sealed with ``SEALER``."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq.asyncio

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.router import Router
from splitserve.services import messages as msg
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.request_group import RequestGroup
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.metrics import Metrics
from tests.support.fake_worker import DEADLINE_S as DEADLINE_S
from tests.support.fake_worker import SEALER as SEALER
from tests.support.fake_worker import FakeWorker as FakeWorker
from tests.support.fake_worker import delta as delta
from tests.support.fake_worker import gate as fake_gate
from tests.support.wait import wait_for_async

PROMPT = [1, 2, 3]
MODEL = "tiny"


async def next_item(group: RequestGroup) -> tuple[int, msg.TokenDelta]:
    return await asyncio.wait_for(anext(group), DEADLINE_S)


def failures(metrics: Metrics, worker: str, reason: str) -> float | None:
    labels = {"model_name": MODEL, "pool": worker.rsplit("-", 1)[0], "worker": worker}
    return metrics.registry.get_sample_value(
        "splitserve:request_failure_total", {**labels, "reason": reason}
    )


Scenario = Callable[[RequestExchange, dict[str, FakeWorker]], Awaitable[None]]


def run(
    roles: dict[str, str], scenario: Scenario, migration_limit: int = 0, **timing: float
) -> None:
    """Start an exchange on these workers (id -> role), wait until every one reported in,
    and run the scenario on the exchange's event loop. migration_limit: 0 (requests on a
    worker that stops fail) unless a test is about migration. timing: the exchange's
    request_timeout_s and restart_wait_s, where a test is about them."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        gate = fake_gate(ctx)
        workers = {worker_id: FakeWorker(ctx, worker_id, role) for worker_id, role in roles.items()}
        metrics = Metrics(MODEL)
        endpoints = [w.endpoint for w in workers.values()]
        pool = WorkerPool(endpoints, metrics, SEALER, heartbeat_timeout_s=60)
        router = Router("cache_aware", "cache_aware")
        exchange = RequestExchange(
            pool, 16, metrics, router, migration_limit=migration_limit, **timing
        )
        exchange.start()
        try:
            for worker in workers.values():
                await worker.heartbeat()
            await wait_for_async(lambda: pool.ready, DEADLINE_S, message="every worker reported in")
            await scenario(exchange, workers)
        finally:
            await exchange.close()
            gate.stop()
            ctx.destroy(linger=0)

    asyncio.run(main())


def submit(exchange: RequestExchange, request_id: str) -> RequestGroup:
    return exchange.submit([(request_id, PROMPT, SamplingParams(max_tokens=4))])
