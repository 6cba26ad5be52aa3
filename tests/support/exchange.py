"""The API server's request exchange (services/api/exchange.py) in-process, against workers
that are real ZMQ sockets in the test (FakeWorker): the test plays every worker."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.router import Router
from splitserve.services import messages as msg
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.request_group import RequestGroup
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import WorkerEndpoint
from splitserve.services.metrics import Metrics
from tests.support.wait import wait_for_async

DEADLINE_S = 5.0
PROMPT = [1, 2, 3]
MODEL = "tiny"


class FakeWorker:
    """A worker's two sockets, bound like a real worker's: requests in, output out."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.requests = ctx.socket(zmq.PULL)
        self.output = ctx.socket(zmq.PUSH)
        for socket in (self.requests, self.output):
            socket.setsockopt(zmq.LINGER, 0)
        request_port = self.requests.bind_to_random_port("tcp://127.0.0.1")
        output_port = self.output.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = WorkerEndpoint(
            worker_id,
            f"tcp://127.0.0.1:{request_port}",
            f"tcp://127.0.0.1:{output_port}",
            role,
            f"tcp://127.0.0.1:{request_port}",
        )

    async def send(self, message: msg.Message) -> None:
        await self.output.send(msg.encode(message))

    async def heartbeat(self, free_blocks: int = 100) -> None:
        await self.send(msg.WorkerStats(self.worker_id, 0, 0, free_blocks, 100, 0.0, 0, 0))

    async def receive(self) -> msg.Message:
        return msg.decode(await asyncio.wait_for(self.requests.recv(), DEADLINE_S))

    async def received_id(self) -> str:
        """The request id of the next GenerateRequest, Reserve or Prefill sent here."""
        message = await self.receive()
        assert isinstance(message, msg.GenerateRequest | msg.Reserve | msg.Prefill), message
        return message.request_id


def delta(
    request_id: str, tokens: list[int], finish: str | None, prompt_tokens: int = 3
) -> msg.OutputBatch:
    return msg.OutputBatch(
        [msg.TokenDelta(request_id, "", tokens, None, finish, None, prompt_tokens, 0)], []
    )


async def next_item(group: RequestGroup) -> tuple[int, msg.TokenDelta]:
    return await asyncio.wait_for(anext(group), DEADLINE_S)


def failures(metrics: Metrics, worker: str, reason: str) -> float | None:
    labels = {"model_name": MODEL, "pool": worker.rsplit("-", 1)[0], "worker": worker}
    return metrics.registry.get_sample_value(
        "splitserve:request_failure_total", {**labels, "reason": reason}
    )


Scenario = Callable[[RequestExchange, dict[str, FakeWorker]], Awaitable[None]]


def run(roles: dict[str, str], scenario: Scenario, migration_limit: int = 0) -> None:
    """Start an exchange on these workers (id -> role), wait until every one reported in,
    and run the scenario on the exchange's event loop. migration_limit: 0 (requests on a
    worker that stops fail) unless a test is about migration."""

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        workers = {worker_id: FakeWorker(ctx, worker_id, role) for worker_id, role in roles.items()}
        metrics = Metrics(MODEL)
        pool = WorkerPool([w.endpoint for w in workers.values()], metrics, heartbeat_timeout_s=60)
        router = Router("cache_aware", "cache_aware")
        exchange = RequestExchange(pool, 16, metrics, router, migration_limit=migration_limit)
        exchange.start()
        try:
            for worker in workers.values():
                await worker.heartbeat()
            await wait_for_async(lambda: pool.ready, DEADLINE_S, message="every worker reported in")
            await scenario(exchange, workers)
        finally:
            await exchange.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def submit(exchange: RequestExchange, request_id: str) -> RequestGroup:
    return exchange.submit([(request_id, PROMPT, SamplingParams(max_tokens=4))])
