"""The API server's request exchange against workers that are real ZMQ sockets in this test:
a WorkerFailed fails at once (503) exactly the requests that wait on that worker, and the
output reader survives messages that do not decode or whose handling raises."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Iterator

import pytest

from splitserve.engine.sampling_params import SamplingParams
from splitserve.router.router import NoWorkerError
from splitserve.services import messages as msg
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.request_group import EngineRequestError
from splitserve.services.sealing import Sealer
from tests.support.exchange import (
    DEADLINE_S,
    MODEL,
    PROMPT,
    SEALER,
    FakeWorker,
    delta,
    failures,
    next_item,
    run,
    submit,
)
from tests.support.wait import wait_for_async


@pytest.fixture
def api_log(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    with caplog.at_level(logging.ERROR, logger="splitserve.api"):
        yield caplog


def test_a_failed_worker_fails_its_requests_at_once_and_takes_no_new_ones() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        first = submit(exchange, "a")  # equal loads: the earliest worker
        assert (await w["both-0"].receive()) == msg.GenerateRequest(
            "a", PROMPT, SamplingParams(max_tokens=4)
        )
        second = submit(exchange, "b")  # both-0 has one request's blocks fewer now
        assert await w["both-1"].received_id() == "b"

        await w["both-0"].send(msg.WorkerFailed("both-0", "RuntimeError: CUDA error"))
        with pytest.raises(EngineRequestError) as failed:
            await next_item(first)
        assert (str(failed.value), failed.value.status) == (
            "worker both-0 failed: RuntimeError: CUDA error",
            503,
        )
        assert failures(exchange.metrics, "both-0", "worker_failed") == 1.0
        assert exchange.pool.pools() == {"both": {"replicas": 2, "ready": 1}}
        assert exchange.pool.worker_ids("both") == ["both-1"]

        await w["both-1"].send(delta("b", [7, 8], "stop"))
        assert await next_item(second) == (
            0,
            msg.TokenDelta("b", "", [7, 8], None, "stop", None, 3, 0),
        )
        third = submit(exchange, "c")
        assert await w["both-1"].received_id() == "c"
        await w["both-1"].send(delta("c", [9], "length"))
        assert (await next_item(third))[1].token_ids == [9]

    run({"both-0": "both", "both-1": "both"}, scenario)


def test_a_failed_prefill_worker_fails_only_the_requests_still_waiting_for_their_prompt() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        prefill, decode = w["prefill-0"], w["decode-0"]
        waiting, streaming = submit(exchange, "a"), submit(exchange, "b")
        for request_id in ("a", "b"):
            assert await decode.received_id() == request_id  # Reserve
            await decode.send(msg.Reserved(request_id))
            assert await prefill.received_id() == request_id  # Prefill
        await decode.send(delta("b", [5], None))
        assert (await next_item(streaming))[1].token_ids == [5]

        await prefill.send(msg.WorkerFailed("prefill-0", "worker loop stopped"))
        with pytest.raises(EngineRequestError, match="worker prefill-0 failed: worker loop"):
            await next_item(waiting)
        # The decode worker is told to free the failed request's reservation.
        assert await decode.receive() == msg.AbortRequest(["a"])
        await decode.send(delta("b", [6], "stop"))
        assert (await next_item(streaming))[1].token_ids == [6]
        assert exchange.num_admitted == 0

    run({"prefill-0": "prefill", "decode-0": "decode"}, scenario)


def test_the_reader_survives_an_undecodable_message(api_log: pytest.LogCaptureFixture) -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        group = submit(exchange, "a")
        await w["both-0"].receive()
        body = b"\xc1 not msgpack"
        tag = hmac.new(SEALER.secret, body, hashlib.sha256).digest()
        await w["both-0"].output.send(tag + body)
        await w["both-0"].send(delta("a", [4], "stop"))
        assert (await next_item(group))[1].token_ids == [4]
        messages = [r.getMessage() for r in api_log.records]
        assert messages == ["dropped a worker message that does not decode"]

    run({"both-0": "both"}, scenario)


def test_a_message_whose_handling_raises_fails_its_request_and_the_reader_goes_on(
    api_log: pytest.LogCaptureFixture,
) -> None:
    """A negative prompt token count decodes but makes the prompt-token counter raise."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        broken, healthy = submit(exchange, "a"), submit(exchange, "b")
        await w["both-0"].receive()
        await w["both-0"].receive()
        await w["both-0"].send(delta("a", [4], "stop", prompt_tokens=-1))
        with pytest.raises(EngineRequestError) as failed:
            await next_item(broken)
        assert failed.value.status == 500
        assert str(failed.value).startswith("the API server failed handling this request's")
        await w["both-0"].send(delta("b", [5], "stop"))
        assert (await next_item(healthy))[1].token_ids == [5]
        assert exchange.num_admitted == 0
        messages = [r.getMessage() for r in api_log.records]
        assert messages == ["handling a worker message failed (request a)"]

    run({"both-0": "both"}, scenario)


def test_a_pool_left_without_workers_refuses_new_requests() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        await w["both-0"].send(msg.WorkerFailed("both-0", "worker loop stopped"))
        await wait_for_async(
            lambda: exchange.pool.worker_ids("both") == [],
            DEADLINE_S,
            message="the failed worker out of the pool",
        )
        with pytest.raises(NoWorkerError, match="no decode worker is taking requests"):
            submit(exchange, "a")
        assert exchange.num_admitted == 0

    run({"both-0": "both"}, scenario)


def test_a_request_that_fails_after_admission_releases_its_slot() -> None:
    """A seed past 64 bits does not encode: the group's requests admitted before the one that
    raised, and that one, leave the queue; more such groups than the bound of 16 (each sending
    its first request) still leave room for a normal request."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        unencodable = SamplingParams(max_tokens=4, seed=2**64)
        for i in range(20):
            sent = (f"{i}-0", PROMPT, SamplingParams(max_tokens=4))
            with pytest.raises(OverflowError):
                exchange.submit([sent, (f"{i}-1", PROMPT, unencodable)])
            assert exchange.num_admitted == 0
            assert await w["both-0"].received_id() == f"{i}-0"
            assert await w["both-0"].receive() == msg.AbortRequest([f"{i}-0", f"{i}-1"])
        group = submit(exchange, "normal")
        assert await w["both-0"].received_id() == "normal"
        await w["both-0"].send(delta("normal", [4], "stop"))
        assert (await next_item(group))[1].token_ids == [4]

    run({"both-0": "both"}, scenario)


def test_the_reader_survives_a_receive_that_raises(api_log: pytest.LogCaptureFixture) -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        receive = exchange.pool.receive
        raised: list[bool] = []

        async def receive_raising_once(timeout_s: float) -> bytes | None:
            if not raised:
                raised.append(True)
                raise OSError("the socket broke")
            return await receive(timeout_s)

        exchange.pool.receive = receive_raising_once  # type: ignore[method-assign]
        group = submit(exchange, "a")
        await w["both-0"].receive()
        await w["both-0"].send(delta("a", [4], "stop"))
        assert (await next_item(group))[1].token_ids == [4]
        messages = [r.getMessage() for r in api_log.records]
        assert messages == ["reading worker output failed; the reader goes on"]

    run({"both-0": "both"}, scenario)


def test_a_disaggregated_pool_left_without_prefill_workers_refuses_new_requests() -> None:
    """Not a GenerateRequest to the decode worker, which cannot compute a prompt."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        await w["prefill-0"].send(msg.WorkerFailed("prefill-0", "worker loop stopped"))
        await wait_for_async(
            lambda: exchange.pool.worker_ids("prefill") == [],
            DEADLINE_S,
            message="the failed worker out of the pool",
        )
        with pytest.raises(NoWorkerError, match="no prefill worker is taking requests"):
            submit(exchange, "a")
        assert exchange.num_admitted == 0

    run({"prefill-0": "prefill", "decode-0": "decode"}, scenario)


def test_a_message_not_sealed_with_the_deployments_secret_is_dropped_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before: any process that reached the API server's output socket could finish, fill or
    fail its requests with a plain msgpack message."""

    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        group = submit(exchange, "a")
        await w["both-0"].receive()
        forged = delta("a", [666], "stop")
        await w["both-0"].output.send(msg.encode(forged))  # no tag at all
        await w["both-0"].send(forged, Sealer(b"another deployment's key"))
        tampered = bytearray(SEALER.seal(forged))
        tampered[-3] ^= 1
        await w["both-0"].output.send(bytes(tampered))
        await w["both-0"].send(delta("a", [4], "stop"))
        assert await next_item(group) == (0, msg.TokenDelta("a", "", [4], None, "stop", None, 3, 0))
        labels = {"model_name": MODEL, "pool": "api", "worker": "api"}
        rejected = exchange.metrics.registry.get_sample_value(
            "splitserve:rejected_messages_total", labels
        )
        assert (rejected, exchange.pool.rejected.count) == (3.0, 3)
        assert [r.getMessage() for r in caplog.records if r.name.startswith("splitserve")] == [
            "API server: dropped a message that is not from this deployment "
            "(its HMAC is missing or wrong); 1 so far"
        ]

    with caplog.at_level(logging.WARNING):
        run({"both-0": "both"}, scenario)
