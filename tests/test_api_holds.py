"""The API server's deadline and its wait for restarts (issue 48): a request past
server.request_timeout_s ends with a 504 and leaves its worker; with the only worker of a pool
stopped, a request waits for the restarted one (holds.py) instead of failing with a 503, and a
new request waits to be admitted. The test plays the workers (tests/support/exchange.py)."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine.sampling_params import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.request_group import EngineRequestError
from tests.support.exchange import PROMPT, FakeWorker, delta, next_item, run, submit


def test_a_request_past_its_deadline_gets_a_504_and_is_aborted_on_its_worker() -> None:
    """Before: a request whose output never came (a lost worker, a stolen output) waited for
    its client's own timeout."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        group = submit(exchange, "a")
        assert await w["both-0"].received_id() == "a"
        with pytest.raises(EngineRequestError) as ended:
            await next_item(group)
        assert (str(ended.value), ended.value.status) == (
            "the request did not finish within 0.5 s (the deadline)",
            504,
        )
        assert await w["both-0"].receive() == msg.AbortRequest(["a"])
        assert exchange.num_admitted == 0
        group.close()

    run({"both-0": "both"}, scenario, request_timeout_s=0.5)


def test_with_its_only_worker_restarting_a_request_waits_and_continues_on_the_new_one() -> None:
    """Before: the kill of a 1P1D deployment's only decode worker failed every request in
    flight with a 503 (85 of 100), though the supervisor had it back in about 5 s."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        first = submit(exchange, "a")
        assert await w["both-0"].received_id() == "a"
        await w["both-0"].send(delta("a", [5], None))
        assert (await next_item(first))[1].token_ids == [5]
        exchange.worker_stopped("both-0", "its process died")
        later = asyncio.create_task(exchange.admit([("b", PROMPT, SamplingParams(max_tokens=4))]))
        await asyncio.sleep(0.3)  # a while with no worker at all: nothing fails
        assert not later.done() and exchange.num_admitted == 1

        restarted = FakeWorker(w["both-0"].requests.context, "both-0", "both")
        exchange.rejoin(restarted.endpoint)
        await restarted.heartbeat()
        received = [await restarted.receive(), await restarted.receive()]
        assert sorted(received, key=lambda m: getattr(m, "request_id", "")) == [
            msg.GenerateRequest("a.m1", [*PROMPT, 5], SamplingParams(max_tokens=3), None, 1),
            msg.GenerateRequest("b", PROMPT, SamplingParams(max_tokens=4)),
        ]
        second = await later
        await restarted.send(delta("a.m1", [6, 7, 8], "length"))
        await restarted.send(delta("b", [9], "stop"))
        assert (await next_item(first))[1].token_ids == [6, 7, 8]
        assert (await next_item(second))[1].token_ids == [9]
        assert exchange.num_admitted == 0

    run({"both-0": "both"}, scenario, migration_limit=3, restart_wait_s=10)


def test_a_worker_that_does_not_come_back_in_time_fails_its_requests_with_a_503() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        group = submit(exchange, "a")
        assert await w["both-0"].received_id() == "a"
        exchange.worker_stopped("both-0", "its process died")
        with pytest.raises(EngineRequestError) as failed:
            await next_item(group)
        assert (str(failed.value), failed.value.status) == (
            "worker both-0 failed: its process died",
            503,
        )
        assert exchange.num_admitted == 0
        group.close()

    run({"both-0": "both"}, scenario, migration_limit=3, restart_wait_s=0.5)
