"""A real DecodeWorker (its loop, ZMQ sockets and a gloo KVTransport, without Ray) on a tiny
random Llama, with the test as its API server and as a prefill worker that sends through the
real TensorSender: a KvHeader is received only into what was reserved for its request. A
header with a dtype outside the allow-list, a shape larger than the reservation or a request
not reserved here is refused without allocating what it claims (4 PiB here: had the worker
tried, torch.empty would have raised and its loop stopped), a reserved request fails with a
503 and its blocks are freed, the channel is dropped, and the next request decodes. The late
KV of an aborted reservation is received into room of the reserved size, keeping the channel."""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import zmq

from splitserve.config import TransferConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import SamplingParams
from splitserve.kvstore.transfer import KVTransport, StoreAddress, start_store
from splitserve.services import messages as msg
from splitserve.services.workers.channels import Outgoing, TensorSender
from splitserve.services.workers.decode import DecodeWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd

pytestmark = pytest.mark.slow
TIMEOUT_S = 10.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
HUGE_BLOCKS = 1 << 40
"""A claimed block count whose KV (4 PiB with this model) no machine can allocate."""
_ids = itertools.count()


class PrefillEnd:
    """The test as prefill worker "prefill-0": KvHeaders and KV through a real TensorSender."""

    def __init__(self, store: StoreAddress, kv_addr: str) -> None:
        self.ctx = zmq.Context()
        self.stop = threading.Event()
        self.errors: queue.Queue[msg.RequestError] = queue.Queue()
        self.thread_failures: list[str] = []
        self.generations: list[int] = []
        """The channel generation of each header sent, in order."""
        transport = KVTransport("prefill-0", store, torch.device("cpu"), "gloo", TIMEOUT_S)
        self.sender = TensorSender(
            "prefill-0", transport, self.ctx, self.stop, self.errors, self.thread_failures.append
        )
        self.kv_addr = kv_addr

    def send(
        self, request_id: str, kv: torch.Tensor, first: int, shape: list[int], dtype: str
    ) -> None:
        """Announce ``shape`` and ``dtype`` for request_id, then send kv as it is."""

        def header(generation: int) -> msg.KvHeader:
            self.generations.append(generation)
            return msg.KvHeader(request_id, "prefill-0", generation, first, None, shape, dtype)

        self.sender.send("decode-0", self.kv_addr, Outgoing(request_id, header, [kv], "KV"))

    def close(self) -> None:
        self.stop.set()
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]


@pytest.fixture(scope="module")
def reference(model: str) -> LLMEngine:
    """A colocated engine on the same model: the prefill's KV, and the tokens to expect."""
    return LLMEngine(EngineConfig(model, enable_prefix_caching=False, **ENGINE))


@pytest.fixture(scope="module")
def cluster(model: str) -> Iterator[tuple[DecodeWorker, ApiEnd, PrefillEnd]]:
    server, address = start_store("127.0.0.1")
    spec = WorkerSpec(
        "decode-0",
        "decode",
        EngineConfig(model, **ENGINE),
        threads=0,  # leave this process's torch thread count alone
        transfer=TransferConfig(backend="gloo", timeout_s=TIMEOUT_S),
        store=address,
    )
    worker = DecodeWorker(spec)
    info = worker.start()
    api, prefill = ApiEnd(info), PrefillEnd(address, info["kv_addr"])
    yield worker, api, prefill
    prefill.close()
    api.close()
    worker.stop()
    del server


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 5000 + 100 for i in range(40)]


def prefilled(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, int]:
    request_id = f"ref-{next(_ids)}"
    engine.add_request(request_id, ids, PARAMS, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    done = engine.handoff.pop_prefilled(request_id)
    return done.kv.clone(), done.first_token


def colocated(engine: LLMEngine, ids: list[int]) -> list[int]:
    request_id = f"ref-{next(_ids)}"
    engine.add_request(request_id, ids, PARAMS)
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens = list(output.outputs[0].token_ids)
    return tokens


def reserve(api: ApiEnd, request_id: str, ids: list[int]) -> None:
    api.send(msg.Reserve(request_id, ids, PARAMS, "prefill-0"))
    api.wait(f"Reserved {request_id}", lambda: api.reserved(request_id), TIMEOUT_S)


def serve(cluster: Any, reference: LLMEngine, seed: int) -> None:
    """A request reserved, prefilled and decoded: its tokens equal the colocated engine's."""
    _, api, prefill = cluster
    request_id, ids = f"r-{next(_ids)}", prompt(seed)
    reserve(api, request_id, ids)
    kv, first = prefilled(reference, ids)
    prefill.send(request_id, kv, first, list(kv.shape), "float32")
    api.wait(f"tokens of {request_id}", lambda: request_id in api.finished, 30)
    assert api.tokens[request_id] == colocated(reference, ids)


def refused(
    cluster: Any, reference: LLMEngine, request_id: str, shape: list[int], dtype: str
) -> None:
    """Send a header that claims shape and dtype (and then the real KV); the sender's send
    fails because the decode worker dropped the channel; nothing arrived, nothing stopped."""
    worker, api, prefill = cluster
    received = worker.transport.bytes_received
    kv, first = prefilled(reference, prompt(99))
    prefill.send(request_id, kv, first, shape, dtype)
    sender_error = prefill.errors.get(timeout=TIMEOUT_S)
    assert (sender_error.request_id, sender_error.status) == (request_id, 503)
    assert sender_error.message.startswith("sending KV to decode-0 failed: ")
    assert worker.transport.bytes_received == received
    assert api.failed_workers() == [] and prefill.thread_failures == []


def free_blocks(api: ApiEnd) -> int:
    stats = api.latest_stats()
    assert stats is not None
    return stats.num_free_blocks


def test_a_header_within_its_reservation_is_received_and_decoded(
    cluster: Any, reference: LLMEngine
) -> None:
    serve(cluster, reference, 1)
    serve(cluster, reference, 2)


def test_a_dtype_outside_the_allow_list_fails_the_request_and_the_next_is_served(
    cluster: Any, reference: LLMEngine
) -> None:
    _, api, _ = cluster
    serve(cluster, reference, 3)
    free = free_blocks(api)
    ids = prompt(4)
    reserve(api, "bad-dtype", ids)
    shape = list(prefilled(reference, ids)[0].shape)
    refused(cluster, reference, "bad-dtype", shape, "int64")
    api.wait("the request's error", lambda: "bad-dtype" in api.errors, TIMEOUT_S)
    expected = "KV for bad-dtype from prefill-0 refused: dtype 'int64' is not one of "
    expected += "['bfloat16', 'float16', 'float32']"
    assert api.errors["bad-dtype"] == msg.RequestError("bad-dtype", expected, 503)
    api.wait("the reservation's blocks freed", lambda: free_blocks(api) == free, 5)
    serve(cluster, reference, 5)


def test_a_shape_larger_than_the_reservation_is_refused_without_allocating_it(
    cluster: Any, reference: LLMEngine
) -> None:
    _, api, _ = cluster
    serve(cluster, reference, 6)
    free = free_blocks(api)
    ids = prompt(7)
    reserve(api, "too-big", ids)
    reserved = list(prefilled(reference, ids)[0].shape)
    claimed = [*reserved[:2], HUGE_BLOCKS, *reserved[3:]]
    refused(cluster, reference, "too-big", claimed, "float32")
    api.wait("the request's error", lambda: "too-big" in api.errors, TIMEOUT_S)
    expected = f"KV for too-big from prefill-0 refused: shape {claimed} announced, "
    expected += f"{reserved} reserved"
    assert api.errors["too-big"] == msg.RequestError("too-big", expected, 503)
    api.wait("the reservation's blocks freed", lambda: free_blocks(api) == free, 5)
    serve(cluster, reference, 8)


def test_a_header_for_a_request_not_reserved_is_refused_without_allocating_it(
    cluster: Any, reference: LLMEngine
) -> None:
    _, api, _ = cluster
    serve(cluster, reference, 9)
    shape = [2, 2, HUGE_BLOCKS, 16, 2, 16]
    refused(cluster, reference, "never-reserved", shape, "float32")
    serve(cluster, reference, 10)
    assert "never-reserved" not in api.errors and api.failed_workers() == []


def test_the_late_kv_of_an_aborted_reservation_is_received_and_the_channel_kept(
    cluster: Any, reference: LLMEngine
) -> None:
    worker, api, prefill = cluster
    serve(cluster, reference, 11)
    free = free_blocks(api)
    ids = prompt(12)
    reserve(api, "aborted", ids)
    api.send(msg.AbortRequest(["aborted"]))
    api.wait("the reservation's blocks freed", lambda: free_blocks(api) == free, 5)
    received = worker.transport.bytes_received
    kv, first = prefilled(reference, ids)
    prefill.send("aborted", kv, first, list(kv.shape), "float32")
    expected = received + kv.numel() * kv.element_size()
    api.wait("the late KV", lambda: worker.transport.bytes_received == expected, TIMEOUT_S)
    serve(cluster, reference, 13)
    assert prefill.generations[-3] == prefill.generations[-2] == prefill.generations[-1]
    assert prefill.errors.empty() and "aborted" not in api.errors
    assert api.failed_workers() == []
