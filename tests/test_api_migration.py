"""Request migration in the API server's exchange, the test playing every worker (real ZMQ
sockets): a request whose worker stops continues on another one as a new attempt that
resumes after the tokens its client already got, in one stream; past server.migration_limit
it fails as before."""

from __future__ import annotations

import pytest

from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvstore.hashing import ImageSpan
from splitserve.services import messages as msg
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.images import PromptImages
from splitserve.services.api.request_group import EngineRequestError
from tests.support.exchange import (
    DEADLINE_S,
    PROMPT,
    FakeWorker,
    delta,
    failures,
    next_item,
    run,
    submit,
)
from tests.support.wait import wait_for_async

MAX4 = SamplingParams(max_tokens=4)


def migrations(exchange: RequestExchange, worker: str, reason: str) -> float | None:
    labels = {"model_name": "tiny", "pool": worker.rsplit("-", 1)[0], "worker": worker}
    return exchange.metrics.registry.get_sample_value(
        "splitserve:request_migrations_total", {**labels, "reason": reason}
    )


async def reserve_and_prefill(decode: FakeWorker, prefill: FakeWorker, request_id: str) -> None:
    assert await decode.received_id() == request_id  # Reserve
    await decode.send(msg.Reserved(request_id))
    assert await prefill.received_id() == request_id  # Prefill


def test_a_decode_worker_that_stops_mid_stream_hands_its_request_to_another() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        prefill, d0, d1 = w["prefill-0"], w["decode-0"], w["decode-1"]
        group = submit(exchange, "a")  # equal loads: the earliest decode worker
        await reserve_and_prefill(d0, prefill, "a")
        await d0.send(delta("a", [5], None, text="Hi"))
        await d0.send(delta("a", [6], None, text=" the"))
        assert (await next_item(group))[1].token_ids == [5]
        assert (await next_item(group))[1].token_ids == [6]

        await d0.send(msg.WorkerFailed("decode-0", "RuntimeError: CUDA error"))
        # The prompt and the two tokens sent, two tokens left, 6 characters of their text
        # with the client; the handed-over prompt's prefill worker is told to drop what it
        # may hold of the first attempt.
        resumed = [*PROMPT, 5, 6]
        params = SamplingParams(max_tokens=2)
        reserve = msg.Reserve("a.m1", resumed, params, "prefill-0", [], 2, 6)
        assert await d1.receive() == reserve
        assert await prefill.receive() == msg.AbortRequest(["a"])
        await d1.send(msg.Reserved("a.m1"))
        assert await prefill.receive() == msg.Prefill(
            "a.m1", resumed, params, "decode-1", d1.endpoint.kv_addr, None, [], None, 2
        )
        await d1.send(delta("a.m1", [7], None, prompt_tokens=5))
        await d1.send(delta("a.m1", [8], "length", prompt_tokens=5))
        assert await next_item(group) == (
            0,
            msg.TokenDelta("a.m1", "", [7], None, None, None, 3, 0),
        )
        assert (await next_item(group))[1].finish_reason == "length"
        assert migrations(exchange, "decode-0", "worker_failed") == 1.0
        assert failures(exchange.metrics, "decode-0", "worker_failed") is None
        assert exchange.num_admitted == 0

    roles = {"prefill-0": "prefill", "decode-0": "decode", "decode-1": "decode"}
    run(roles, scenario, migration_limit=3)


def test_a_prefill_worker_that_stops_before_its_handoff_hands_the_prompt_to_another() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        p0, p1, decode = w["prefill-0"], w["prefill-1"], w["decode-0"]
        group = submit(exchange, "a")
        await reserve_and_prefill(decode, p0, "a")

        await p0.send(msg.WorkerFailed("prefill-0", "OSError: disk tier write failed"))
        assert await decode.receive() == msg.AbortRequest(["a"])
        assert await decode.receive() == msg.Reserve("a.m1", PROMPT, MAX4, "prefill-1", [], 0)
        await decode.send(msg.Reserved("a.m1"))
        assert await p1.received_id() == "a.m1"
        await decode.send(delta("a.m1", [5, 6, 7, 8], "length"))
        assert (await next_item(group))[1].token_ids == [5, 6, 7, 8]
        assert migrations(exchange, "prefill-0", "worker_failed") == 1.0

    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode"}
    run(roles, scenario, migration_limit=3)


IMAGES = PromptImages([ImageSpan("ab" * 32, 1, 1)], [msg.ImageData("ab" * 32, b"a png")])


def test_a_vision_worker_that_stops_before_its_handoff_hands_the_images_to_another() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        prefill, decode, v0, v1 = w["prefill-0"], w["decode-0"], w["vision-0"], w["vision-1"]
        group = exchange.submit([("a", PROMPT, MAX4)], images=IMAGES)
        assert await decode.received_id() == "a"  # Reserve
        assert await v0.receive() == msg.EncodeImages(
            "a", IMAGES.data, "prefill-0", prefill.endpoint.kv_addr
        )

        await v0.send(msg.WorkerFailed("vision-0", "RuntimeError: CUDA error"))
        assert await decode.receive() == msg.AbortRequest(["a"])
        assert await decode.receive() == msg.Reserve(
            "a.m1", PROMPT, MAX4, "prefill-0", IMAGES.spans, 0
        )
        assert await v1.receive() == msg.EncodeImages(
            "a.m1", IMAGES.data, "prefill-0", prefill.endpoint.kv_addr
        )
        await decode.send(msg.Reserved("a.m1"))
        prefill_message = await prefill.receive()
        assert isinstance(prefill_message, msg.Prefill)
        assert (prefill_message.request_id, prefill_message.images) == ("a.m1", IMAGES.spans)
        await decode.send(delta("a.m1", [5, 6, 7, 8], "length"))
        assert (await next_item(group))[1].token_ids == [5, 6, 7, 8]
        assert migrations(exchange, "vision-0", "worker_failed") == 1.0
        assert exchange.num_admitted == 0

    roles = {"prefill-0": "prefill", "decode-0": "decode", "vision-0": "vision"}
    run({**roles, "vision-1": "vision"}, scenario, migration_limit=3)


def test_a_request_past_its_migration_limit_fails_and_an_abort_reaches_its_current_attempt() -> (
    None
):
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        b0, b1 = w["both-0"], w["both-1"]
        first, second = submit(exchange, "a"), submit(exchange, "b")
        assert await b0.received_id() == "a"
        assert await b1.received_id() == "b"
        await b0.send(delta("a", [5], None))
        assert (await next_item(first))[1].token_ids == [5]

        await b0.send(msg.WorkerFailed("both-0", "worker loop stopped"))
        assert await b1.receive() == msg.GenerateRequest(
            "a.m1", [*PROMPT, 5], SamplingParams(max_tokens=3), None, 1
        )
        await b1.send(msg.WorkerFailed("both-1", "worker loop stopped"))
        with pytest.raises(EngineRequestError) as failed:  # its one migration is spent
            await next_item(first)
        assert (str(failed.value), failed.value.status) == (
            "worker both-1 failed: worker loop stopped",
            503,
        )
        # b (no migration spent) waits for a restart (holds.py) and its client leaves.
        assert failures(exchange.metrics, "both-1", "worker_failed") == 1.0  # a.m1
        assert migrations(exchange, "both-0", "worker_failed") == 1.0
        assert exchange.num_admitted == 1
        second.close()
        assert exchange.num_admitted == 0
        first.close()

    run({"both-0": "both", "both-1": "both"}, scenario, migration_limit=1)


def test_a_client_that_goes_away_aborts_the_migrated_attempt() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        b0, b1 = w["both-0"], w["both-1"]
        group = submit(exchange, "a")
        assert await b0.received_id() == "a"
        await b0.send(msg.WorkerFailed("both-0", "worker loop stopped"))
        assert await b1.received_id() == "a.m1"
        group.close()
        assert await b1.receive() == msg.AbortRequest(["a.m1"])
        assert exchange.num_admitted == 0

    run({"both-0": "both", "both-1": "both"}, scenario, migration_limit=3)


def test_a_workers_503_migrates_the_request_and_a_400_fails_it() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        b0, b1 = w["both-0"], w["both-1"]
        moved, refused = submit(exchange, "a"), submit(exchange, "b")
        assert await b0.received_id() == "a"
        assert await b1.received_id() == "b"
        await b1.heartbeat(free_blocks=1000)  # the most free blocks: chosen next
        await wait_for_async(
            lambda: exchange.pool.find("both-1").candidate(0, 60).num_free_blocks > 900,
            DEADLINE_S,
            message="both-1's stats",
        )
        lost_kv = msg.RequestError("a", "KV from prefill-0 did not arrive: closed", 503)
        await b0.send(msg.OutputBatch([], [lost_kv]))
        assert await b0.receive() == msg.AbortRequest(["a"])  # the hop that failed it, too
        assert await b1.received_id() == "a.m1"
        await b1.send(delta("a.m1", [5], "stop"))
        assert (await next_item(moved))[1].token_ids == [5]
        assert migrations(exchange, "both-0", "request_failed") == 1.0

        await b1.send(msg.OutputBatch([], [msg.RequestError("b", "prompt too long", 400)]))
        with pytest.raises(EngineRequestError, match="prompt too long"):
            await next_item(refused)
        assert exchange.num_admitted == 0

    run({"both-0": "both", "both-1": "both"}, scenario, migration_limit=3)


def test_a_restarted_worker_rejoins_its_pool_under_its_id() -> None:
    async def scenario(exchange: RequestExchange, w: dict[str, FakeWorker]) -> None:
        exchange.worker_stopped("both-0", "its process died")
        assert exchange.pool.pools() == {"both": {"replicas": 2, "ready": 1}}
        assert exchange.pool.worker_ids("both") == ["both-1"]

        restarted = FakeWorker(w["both-0"].requests.context, "both-0", "both")
        exchange.rejoin(restarted.endpoint)
        await restarted.heartbeat(free_blocks=1000)  # the most free blocks: chosen first
        await wait_for_async(
            lambda: exchange.pool.pools() == {"both": {"replicas": 2, "ready": 2}},
            DEADLINE_S,
            message="the restarted worker ready",
        )
        assert exchange.pool.worker_ids("both") == ["both-1", "both-0"]
        group = submit(exchange, "a")
        assert await restarted.received_id() == "a"
        await restarted.send(delta("a", [5], "stop"))
        assert (await next_item(group))[1].token_ids == [5]
        restarts = exchange.metrics.registry.get_sample_value(
            "splitserve:worker_restarts_total",
            {"model_name": "tiny", "pool": "both", "worker": "both-0"},
        )
        assert restarts == 1.0

    run({"both-0": "both", "both-1": "both"}, scenario, migration_limit=3)
