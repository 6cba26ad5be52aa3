"""A worker's sockets admit only the deployment's processes (CurveZMQ, splitserve/curve.py) and
only messages of the size they carry (services/workers/limits.py): issue 48, findings 6 and 7.
A real EngineWorker (its loop and sockets, without Ray) on a tiny random Llama."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import zmq

from splitserve.engine.request import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.workers import limits
from splitserve.services.workers.engine_worker import EngineWorker
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd, colocated_worker

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
OVERSIZED = 256 << 20
SEND_BIG = """
import sys, zmq
from splitserve import curve
from splitserve.services.sealing import Sealer
keys = Sealer(bytes.fromhex(sys.argv[2])).curve_keys()
socket = curve.client(zmq.Context().socket(zmq.PUSH), keys)
socket.setsockopt(zmq.LINGER, 20000)
socket.connect(sys.argv[1])
socket.send(bytes(int(sys.argv[3])))
socket.close()
"""


@pytest.fixture(scope="module")
def worker(
    smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineWorker, ApiEnd]]:
    model = tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]
    with colocated_worker(model, **ENGINE) as started:
        yield started


def serve(api: ApiEnd, request_ids: list[str]) -> None:
    for i, request_id in enumerate(request_ids):
        api.send(msg.GenerateRequest(request_id, [100 + i, 200, 300], GREEDY))
    api.wait("every request finished", lambda: set(request_ids) <= api.finished, 30)
    assert all(len(api.tokens[r]) == 4 for r in request_ids)


def test_a_socket_without_the_key_takes_no_output(worker: tuple[EngineWorker, ApiEnd]) -> None:
    """Before: a PULL socket connected to the output port took its round-robin share of every
    batch (8 of 8 requests' tokens in the issue's run), and their clients hung."""
    engine_worker, api = worker
    output_addr = engine_worker.start()["output_addr"]  # the started worker's info again
    ctx = zmq.Context()
    plain = ctx.socket(zmq.PULL)
    plain.connect(output_addr)
    knows_public_key = ctx.socket(zmq.PULL)  # a key pair of its own: the gate refuses it
    public, secret = zmq.curve_keypair()
    knows_public_key.curve_serverkey = engine_worker.sealer.curve_keys().public
    knows_public_key.curve_publickey, knows_public_key.curve_secretkey = public, secret
    knows_public_key.connect(output_addr)
    refused = engine_worker.gate.refused
    try:
        serve(api, [f"theft-{i}" for i in range(8)])
        assert not plain.poll(200) and not knows_public_key.poll(200)
        assert engine_worker.gate.refused > refused
    finally:
        ctx.destroy(linger=0)


def peak_rss_growth(action: Any) -> int:
    """How far this process's peak resident size rises above its current one during action."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak (VmHWM) restarts from the current size
    before = vm("VmRSS")
    action()
    return vm("VmHWM") - before


def vm(field: str) -> int:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith(field + ":"))
    return int(line.split()[1]) * 1024


def test_an_oversized_message_is_dropped_unbuffered_and_the_worker_keeps_serving(
    worker: tuple[EngineWorker, ApiEnd],
) -> None:
    """Before: the request socket took a message of any size; one of 1.2 GB raised a decode
    worker from 1.0 to 2.7 GB resident before the seal check dropped it. Now the sender (one
    with the key: the gate stops everyone else first) is cut off once it announces the size."""
    engine_worker, api = worker
    limit = limits.request_bytes(1 << 20, 512)
    assert limit == 2 * (1 << 20) + 2 * 9 * 512 + (64 << 10)
    assert 50 * limit < OVERSIZED
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    args = [engine_worker.request_addr, engine_worker.sealer.secret.hex(), str(OVERSIZED)]

    def send() -> None:
        subprocess.run([sys.executable, "-c", SEND_BIG, *args], env=env, check=True, timeout=60)

    assert peak_rss_growth(send) < 32 << 20
    serve(api, ["after-the-big-one"])
