"""A KV transfer in flight does not stop a decode worker's steps.

A real DecodeWorker (its loop, ZMQ sockets and a gloo KVTransport, without Ray) on a tiny
random Llama decodes a long request while the test, as prefill worker "prefill-0" sending
through the real TensorSender, has sent a second request's KvHeader and holds its tensors back
for ``DELAY_S`` (transfer.fault_send_delay_s: a pause between a header and its tensors). The
worker's receiver thread waits in the transport's recv meanwhile, on a channel already up. The
running request's tokens keep arriving through that window with no gap longer than
``MAX_GAP_S``; had the loop thread received the tensors itself, it would have stopped for the
whole window. Then the late request is adopted between steps and decodes the colocated
engine's tokens, and the running request's tokens equal the colocated engine's too.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.request import SamplingParams
from splitserve.services import messages as msg
from splitserve.services.workers.decode import DecodeWorker
from tests.support.decode_worker import PrefillEnd, colocated, decode_cluster, prefilled, prompt
from tests.support.decode_worker import reserve as reserve_on
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd

pytestmark = pytest.mark.slow
TIMEOUT_S = 10.0
DELAY_S = 1.5
"""How long the sender holds a request's tensors back after its header."""
MAX_GAP_S = 0.5
"""The longest the running request may go without a token while a transfer is in flight."""
MAX_LEN = 8192
RUNNING = SamplingParams(temperature=0.0, max_tokens=MAX_LEN - 100, ignore_eos=True)
LATE = SamplingParams(temperature=0.0, max_tokens=8)
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": MAX_LEN}


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tiny-llama")
    return tiny_model(smollm2_tokenizer, path, max_position_embeddings=MAX_LEN)[1]


@pytest.fixture(scope="module")
def reference(model: str) -> LLMEngine:
    """A colocated engine on the same model: the prefill's KV, and the tokens to expect."""
    return LLMEngine(EngineConfig(model, enable_prefix_caching=False, **ENGINE))


@pytest.fixture(scope="module")
def cluster(model: str) -> Iterator[tuple[DecodeWorker, ApiEnd, PrefillEnd]]:
    with decode_cluster(model, ENGINE, TIMEOUT_S, DELAY_S) as started:
        yield started


def reserve(api: ApiEnd, request_id: str, ids: list[int], params: SamplingParams) -> None:
    reserve_on(api, request_id, ids, params, TIMEOUT_S)


def running_tokens(api: ApiEnd) -> int:
    return len(api.tokens.get("running", []))


def progress_gaps(samples: list[tuple[float, int]], end: float) -> list[float]:
    """The seconds between the running request's token arrivals from the first sample up to
    end; samples: (time, its tokens so far), in time order."""
    arrivals = [t for (_, before), (t, n) in itertools.pairwise(samples) if n > before]
    moments = [samples[0][0], *(t for t in arrivals if t < end), end]
    return [b - a for a, b in itertools.pairwise(moments)]


def test_decode_steps_go_on_while_a_kv_transfer_is_in_flight_then_it_is_adopted(
    cluster: Any, reference: LLMEngine
) -> None:
    _, api, prefill = cluster
    running, late = prompt(1), prompt(2)
    reserve(api, "running", running, RUNNING)
    prefill.send("running", *prefilled(reference, running, RUNNING))  # the channel comes up
    api.wait("the running request's tokens", lambda: running_tokens(api) > 8, 30)
    reserve(api, "late", late, LATE)
    kv, first = prefilled(reference, late, LATE)

    samples = [(time.monotonic(), running_tokens(api))]
    prefill.send("late", kv, first)  # the header now, the tensors DELAY_S later

    def late_arrived() -> bool:
        samples.append((time.monotonic(), running_tokens(api)))
        return "late" in api.tokens

    api.wait("the late request's first token", late_arrived, TIMEOUT_S)
    sent, adopted = samples[0][0], samples[-1][0]
    api.wait("the late request's tokens", lambda: "late" in api.finished, TIMEOUT_S)
    api.send(msg.AbortRequest(["running"]))

    assert adopted - sent >= DELAY_S  # the tensors were held back that long
    assert "running" not in api.finished, "the running request ended before the window did"
    gaps = progress_gaps(samples, adopted)
    tokens = samples[-1][1] - samples[0][1]
    window = f"{tokens} tokens in {adopted - sent:.2f} s, longest gap {max(gaps):.3f} s"
    assert max(gaps) < MAX_GAP_S, window
    assert tokens > 20, window
    assert api.tokens["late"] == colocated(reference, late, LATE)
    decoded = api.tokens["running"]
    params = SamplingParams(temperature=0.0, max_tokens=len(decoded), ignore_eos=True)
    assert decoded == colocated(reference, running, params)
    assert prefill.errors.empty() and prefill.thread_failures == [] and api.errors == {}
    assert api.failed_workers() == []
