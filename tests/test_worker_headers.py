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
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.workers.decode import DecodeWorker
from tests.support import decode_worker
from tests.support.decode_worker import PrefillEnd, colocated, decode_cluster, prompt
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd

pytestmark = pytest.mark.slow
TIMEOUT_S = 10.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
HUGE_BLOCKS = 1 << 40
"""A claimed block count whose KV (4 PiB with this model) no machine can allocate."""
_ids = itertools.count()


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]


@pytest.fixture(scope="module")
def reference(model: str) -> LLMEngine:
    """A colocated engine on the same model: the prefill's KV, and the tokens to expect."""
    return LLMEngine(EngineConfig(model, enable_prefix_caching=False, **ENGINE))


@pytest.fixture(scope="module")
def cluster(model: str) -> Iterator[tuple[DecodeWorker, ApiEnd, PrefillEnd]]:
    with decode_cluster(model, ENGINE, TIMEOUT_S) as started:
        yield started


def prefilled(engine: LLMEngine, ids: list[int]) -> tuple[torch.Tensor, int]:
    return decode_worker.prefilled(engine, ids, PARAMS)


def reserve(api: ApiEnd, request_id: str, ids: list[int]) -> None:
    decode_worker.reserve(api, request_id, ids, PARAMS, TIMEOUT_S)


def serve(cluster: Any, reference: LLMEngine, seed: int) -> None:
    """A request reserved, prefilled and decoded: its tokens equal the colocated engine's."""
    _, api, prefill = cluster
    request_id, ids = f"r-{next(_ids)}", prompt(seed)
    reserve(api, request_id, ids)
    kv, first = prefilled(reference, ids)
    prefill.send(request_id, kv, first, list(kv.shape), "float32")
    api.wait(f"tokens of {request_id}", lambda: request_id in api.finished, 30)
    assert api.tokens[request_id] == colocated(reference, ids, PARAMS)


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
    """The decode worker's free blocks once it is idle and its stats show it."""
    api.wait("the worker's stats while idle", api.idle_stats, TIMEOUT_S)
    stats = api.idle_stats()
    assert stats is not None
    return stats.num_free_blocks


def wait_freed(api: ApiEnd, free: int) -> None:
    """Wait until the worker's idle stats show ``free`` blocks free again."""

    def freed() -> bool:
        stats = api.idle_stats()
        return stats is not None and stats.num_free_blocks == free

    try:
        api.wait(f"the reservation's blocks freed ({free} free)", freed, 5)
    except AssertionError as exc:
        stats = api.latest_stats()
        shown = stats and (stats.num_free_blocks, stats.num_running, stats.num_waiting)
        raise AssertionError(f"{exc}; latest stats (free, running, waiting): {shown}") from None


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
    wait_freed(api, free)
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
    wait_freed(api, free)
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
    wait_freed(api, free)
    received = worker.transport.bytes_received
    kv, first = prefilled(reference, ids)
    prefill.send("aborted", kv, first, list(kv.shape), "float32")
    expected = received + kv.numel() * kv.element_size()
    api.wait("the late KV", lambda: worker.transport.bytes_received == expected, TIMEOUT_S)
    serve(cluster, reference, 13)
    assert prefill.generations[-3] == prefill.generations[-2] == prefill.generations[-1]
    assert prefill.errors.empty() and "aborted" not in api.errors
    assert api.failed_workers() == []
