"""A worker's two ZMQ sockets, bound as a real worker binds them, driven by the test: the API
server's exchange connects to them as to a worker. Messages are sealed with ``SEALER``, the
deployment secret the tests' worker pools are given, and the sockets are CurveZMQ servers with
its keys (their context needs a gate: ``gate``)."""

from __future__ import annotations

import asyncio
import dataclasses

import zmq
import zmq.asyncio

from splitserve import curve
from splitserve.services import messages as msg
from splitserve.services.api.worker_view import WorkerEndpoint
from splitserve.services.sealing import Sealer

DEADLINE_S = 5.0
SEALER = Sealer()


def gate(ctx: zmq.asyncio.Context) -> curve.Gate:
    """The deployment's gate on a context for fake workers (splitserve/curve.py); stop it
    before the context is destroyed."""
    return curve.Gate(ctx, SEALER.curve_keys())


class FakeWorker:
    """A worker's two sockets, bound like a real worker's: requests in, output out."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        keys = SEALER.curve_keys()
        self.requests = curve.server(ctx.socket(zmq.PULL), keys)
        self.output = curve.server(ctx.socket(zmq.PUSH), keys)
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

    async def send(self, message: msg.Message, sealer: Sealer = SEALER) -> None:
        await self.output.send(sealer.seal(message))

    async def heartbeat(self, free_blocks: int = 100, hash_root: int = 0) -> None:
        stats = msg.WorkerStats(
            worker_id=self.worker_id, num_free_blocks=free_blocks, num_total_blocks=100
        )
        await self.send(dataclasses.replace(stats, hash_root=hash_root))

    async def receive(self) -> msg.Message:
        return SEALER.unseal(await asyncio.wait_for(self.requests.recv(), DEADLINE_S))

    async def received_id(self) -> str:
        """The request id of the next GenerateRequest, Reserve or Prefill sent here."""
        message = await self.receive()
        assert isinstance(message, msg.GenerateRequest | msg.Reserve | msg.Prefill), message
        return message.request_id


def delta(
    request_id: str, tokens: list[int], finish: str | None, prompt_tokens: int = 3, text: str = ""
) -> msg.OutputBatch:
    return msg.OutputBatch(
        [msg.TokenDelta(request_id, text, tokens, None, finish, None, prompt_tokens, 0)], []
    )
