"""Heartbeats come from a thread of the worker's own: a real EngineWorker (its loop and ZMQ
sockets, without Ray) on a tiny random Llama whose engine step is made to take 3 s keeps
sending Heartbeats (with the round's age) while its loop sends nothing. And the API server's
pool counts a Heartbeat as the worker being alive."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.request import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.api.worker_pool import WorkerPool
from splitserve.services.api.worker_view import WorkerEndpoint
from splitserve.services.metrics import Metrics
from splitserve.services.sealing import Sealer
from splitserve.services.workers.engine_worker import EngineWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}


@pytest.fixture(scope="module")
def worker(
    smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineWorker, ApiEnd]]:
    model = tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]
    worker = EngineWorker(WorkerSpec("both-0", "both", EngineConfig(model, **ENGINE), threads=0))
    info = worker.start()
    api = ApiEnd(info, worker.sealer)
    try:
        yield worker, api
    finally:
        api.close()
        worker.stop()


def test_heartbeats_continue_through_a_step_longer_than_the_stats_interval(
    worker: tuple[EngineWorker, ApiEnd],
) -> None:
    engine_worker, api = worker
    engine = engine_worker.engine
    real_step = engine.step
    slow = {"left": 1}

    def step() -> Any:
        if slow["left"]:
            slow["left"] -= 1
            time.sleep(3.0)
        return real_step()

    engine.step = step  # type: ignore[method-assign]
    try:
        params = SamplingParams(temperature=0.0, max_tokens=2)
        api.send(msg.GenerateRequest("slow-0", list(range(100, 140)), params))
        api.wait("the slow request's tokens", lambda: "slow-0" in api.finished, 30)
    finally:
        engine.step = real_step  # type: ignore[method-assign]
    beats = [m for m in api.seen if isinstance(m, msg.Heartbeat)]
    busy = [b.loop_busy_s for b in beats if b.loop_busy_s >= 0.9]
    assert len(busy) >= 2, [b.loop_busy_s for b in beats]  # two or more during the 3 s step
    assert max(busy) < 3.5 and all(b.worker_id == "both-0" for b in beats)


def test_the_pool_counts_a_heartbeat_as_alive() -> None:
    endpoint = WorkerEndpoint("decode-0", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2", "decode")
    pool = WorkerPool([endpoint], Metrics("tiny"), Sealer(), heartbeat_timeout_s=1.0)
    worker = pool.find("decode-0")
    try:
        assert not worker.healthy(time.monotonic(), 1.0)
        pool.on_heartbeat(msg.Heartbeat("decode-0", 20.0))
        assert worker.healthy(time.monotonic(), 1.0) and worker.loop_busy_s == 20.0
        pool.on_heartbeat(msg.Heartbeat("not-a-worker", 0.0))  # ignored
    finally:
        pool.close()
