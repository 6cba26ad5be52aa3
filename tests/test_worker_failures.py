"""A worker whose loop meets an unexpected error fails only the requests it concerns (500:
the request itself may be the cause) and goes on; one whose fault persists (rounds that keep
raising, a receiver thread that stopped) fails every request it holds at once (503) and tells
the API server with WorkerFailed, instead of going silent until the API server's heartbeat
timeout. Real workers in-process (their loops, ZMQ sockets, gloo), the test as their API
server; the fault itself is injected (an engine step, a reservation or a receive that
raises)."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from splitserve import curve
from splitserve.config import TransferConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Request, SamplingParams
from splitserve.kvstore.rendezvous import StoreAddress, start_store
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.decode import DecodeWorker
from splitserve.services.workers.engine_worker import EngineWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd

pytestmark = pytest.mark.slow
FAIL_WITHIN_S = 1.0
LONG = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
_ids = itertools.count()
SEALER = Sealer()
"""The test deployment's secret: the store admits only its holders."""


class Injected(RuntimeError):
    """The fault the test injects."""


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]


@pytest.fixture(scope="module")
def store() -> Iterator[StoreAddress]:
    server, address = start_store("127.0.0.1", SEALER.store_key())
    yield address
    server.close()


def spec(role: str, model: str, store: StoreAddress | None = None) -> WorkerSpec:
    return WorkerSpec(
        f"{role}-{next(_ids)}",
        role,
        EngineConfig(model, **ENGINE),
        threads=0,  # leave this process's torch thread count alone
        transfer=TransferConfig(backend="gloo", timeout_s=10.0),
        store=store,
        sealer=SEALER,
    )


def prompt(seed: int) -> list[int]:
    return [seed * 100 + i for i in range(100, 130)]


def assert_failed_at_once(
    api: ApiEnd, worker_id: str, held: list[str], reason: str, since_s: float
) -> None:
    """Each held request got a 503 naming the reason, then WorkerFailed, within a second."""
    assert since_s < FAIL_WITHIN_S
    failed = api.failed_workers()
    assert failed == [msg.WorkerFailed(worker_id, reason)]
    error = f"worker {worker_id} failed: {reason}"
    assert {r: api.errors[r] for r in held} == {r: msg.RequestError(r, error, 503) for r in held}


def assert_only_these_failed(api: ApiEnd, worker_id: str, failed: list[str], reason: str) -> None:
    """The requests named got a 500 naming the reason; no other request failed, and the worker
    did not give up (no WorkerFailed)."""
    error = f"worker {worker_id} failed this request: {reason}"
    assert api.errors == {r: msg.RequestError(r, error, 500) for r in failed}
    assert api.failed_workers() == []


def test_an_engine_step_that_raises_fails_its_requests_and_the_loop_goes_on(
    model: str, caplog: pytest.LogCaptureFixture
) -> None:
    worker = EngineWorker(spec("both", model))
    api = ApiEnd(worker.start(), worker.sealer)
    step = worker.engine.step
    raised: list[bool] = []

    def step_raising_once() -> Any:
        if "second" in worker.engine.requests and not raised:
            raised.append(True)
            raise Injected("the step broke")
        return step()

    worker.engine.step = step_raising_once
    short = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    try:
        api.send(msg.GenerateRequest("first", prompt(1), LONG))
        api.wait("first tokens", lambda: len(api.tokens.get("first", [])) >= 2, 30)
        with caplog.at_level(logging.ERROR, logger="splitserve.worker"):
            api.send(msg.GenerateRequest("second", prompt(2), LONG))
            seconds = api.wait("the errors", lambda: len(api.errors) == 2, 10)
        assert seconds < FAIL_WITHIN_S
        api.send(msg.GenerateRequest("third", prompt(3), short))
        api.wait("third finished", lambda: "third" in api.finished, 30)
        assert len(api.tokens["third"]) == 5
        reason = "Injected: the step broke"
        assert_only_these_failed(api, worker.worker_id, ["first", "second"], reason)
        assert f"worker {worker.worker_id}: failed ['first', 'second']" in caplog.text
        assert "Injected: the step broke" in caplog.text  # the traceback is logged
        assert worker.engine.requests == {}
    finally:
        api.close()
        worker.stop()


def test_a_step_that_keeps_raising_fails_the_worker_at_once(model: str) -> None:
    worker = EngineWorker(spec("both", model))
    api = ApiEnd(worker.start(), worker.sealer)

    def step_raising() -> Any:
        raise Injected("the device is gone")

    worker.engine.step = step_raising
    try:
        for name in ("first", "second", "third"):
            api.send(msg.GenerateRequest(name, prompt(1), LONG))
            api.wait(f"{name} failed", lambda name=name: name in api.errors, 10)
        seconds = api.wait("WorkerFailed", api.failed_workers, 10)
        reason = "Injected: the device is gone"
        assert_failed_at_once(api, worker.worker_id, [], reason, seconds)
        error = f"worker {worker.worker_id} failed this request: {reason}"
        assert api.errors == {r: msg.RequestError(r, error, 500) for r in ("first", "second")} | {
            "third": msg.RequestError("third", f"worker {worker.worker_id} failed: {reason}", 503)
        }
    finally:
        api.close()
        worker.stop()


def test_a_reservation_that_raises_fails_only_its_request(model: str, store: StoreAddress) -> None:
    worker = DecodeWorker(spec("decode", model, store))
    api = ApiEnd(worker.start(), worker.sealer)
    reserve = worker.engine.handoff.reserve

    def reserve_once(req: Request) -> bool:
        if req.request_id == "second":
            raise Injected("no reservation")
        return reserve(req)

    worker.engine.handoff.reserve = reserve_once
    try:
        api.send(msg.Reserve("first", prompt(1), LONG, "prefill-0"))
        api.wait("Reserved", lambda: api.reserved("first"), 10)
        api.send(msg.Reserve("second", prompt(2), LONG, "prefill-0"))
        seconds = api.wait("the error", lambda: "second" in api.errors, 10)
        assert seconds < FAIL_WITHIN_S
        api.send(msg.Reserve("third", prompt(3), LONG, "prefill-0"))
        api.wait("Reserved", lambda: api.reserved("third"), 10)
        assert_only_these_failed(api, worker.worker_id, ["second"], "Injected: no reservation")
        assert sorted(worker.engine.handoff.reserved) == ["first", "third"]
    finally:
        api.close()
        worker.stop()


def test_a_receiver_thread_that_raises_fails_the_worker_at_once(
    model: str, store: StoreAddress
) -> None:
    worker = DecodeWorker(spec("decode", model, store))
    api = ApiEnd(worker.start(), worker.sealer)

    def recv(peer: str, generation: int, out: torch.Tensor) -> None:
        raise Injected("the receive broke")

    worker.transport.recv = recv
    try:
        api.send(msg.Reserve("first", prompt(1), LONG, "prefill-0"))
        api.wait("Reserved", lambda: api.reserved("first"), 10)
        shape = [2, 2, 2, 16, 2, 16]  # the reservation's: 30 tokens in 2 blocks
        header = msg.KvHeader("first", "prefill-0", 0, 7, None, shape, "float32")
        push = curve.client(api.ctx.socket(zmq.PUSH), api.sealer.curve_keys())
        push.connect(worker.kv_addr)
        push.send(api.sealer.seal(header))
        seconds = api.wait("WorkerFailed", api.failed_workers, 10)
        reason = "ThreadFailed: thread recv-prefill-0: Injected: the receive broke"
        assert_failed_at_once(api, worker.worker_id, ["first"], reason, seconds)
    finally:
        api.close()
        worker.stop()
