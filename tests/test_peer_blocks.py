"""Two real PrefillWorkers (their loops, ZMQ sockets and a gloo KVTransport, without Ray) on
a tiny random Llama with SmolLM2's tokenizer, and the test as their decode worker: B pulls a
prompt's prefix from A's device cache, and every way the pull can miss (fewer blocks, unknown
hashes, an unreachable peer) computes the prompt in full. Output: the first token equals the
reference and the KV handed to decode matches a prefill without any cache."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
import torch
import zmq

from splitserve import curve
from splitserve.config import KVStoreConfig, PrefixIndexConfig, TransferConfig
from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.rendezvous import StoreAddress, start_store
from splitserve.kvstore.transfer import KVTransport
from splitserve.services import messages as msg
from splitserve.services.sealing import Sealer
from splitserve.services.workers.channels import peer_name
from splitserve.services.workers.prefill import PrefillWorker
from splitserve.services.workers.spec import WorkerSpec
from tests.support.server_process import free_port
from tests.support.tiny_models import tiny_model

pytestmark = pytest.mark.slow
TIMEOUT_S = 4.0
PARAMS = SamplingParams(temperature=0.0, max_tokens=4)
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
INDEX = PrefixIndexConfig(url="memory://", ttl_s=3600.0, publish_interval_s=0.5)
STORE = KVStoreConfig(host_bytes=0, retention={"chat": 3600.0}, default_class="chat")
_ids = itertools.count()
SEALER = Sealer()
"""The test deployment's secret: the two prefill workers and the test's decode end share it."""


class Decode:
    """The decode end: a KV header socket and a transport that receives the prompt's KV."""

    def __init__(self, store: StoreAddress) -> None:
        self.ctx = zmq.Context()
        self.gate = curve.Gate(self.ctx, SEALER.curve_keys())
        self.pull = curve.server(self.ctx.socket(zmq.PULL), SEALER.curve_keys())
        self.addr = f"tcp://127.0.0.1:{self.pull.bind_to_random_port('tcp://127.0.0.1')}"
        name = peer_name("decode-0", self.addr)  # as a DecodeWorker names itself
        self.transport = KVTransport(
            name, store, torch.device("cpu"), "gloo", TIMEOUT_S, key=SEALER.store_key()
        )

    def receive(self) -> tuple[msg.KvHeader, torch.Tensor]:
        assert self.pull.poll(60_000), "no KV header within 60 s"
        header = SEALER.unseal(self.pull.recv())
        assert isinstance(header, msg.KvHeader)
        kv = torch.empty(header.shape)
        self.transport.recv(header.sender, header.generation, kv)
        return header, kv


class Worker:
    """A started PrefillWorker and its request socket's address."""

    def __init__(self, worker_id: str, store: StoreAddress, model: str) -> None:
        spec = WorkerSpec(
            worker_id,
            "prefill",
            EngineConfig(model, **ENGINE),
            threads=0,  # leave this process's torch thread count alone
            transfer=TransferConfig(backend="gloo", timeout_s=TIMEOUT_S),
            store=store,
            prefix_index=INDEX,
            kv_store=STORE,
            sealer=SEALER,
        )
        self.worker = PrefillWorker(spec)
        self.addr = str(self.worker.start()["request_addr"])

    def remote_tokens(self) -> tuple[int, int]:
        """(prompt tokens pulled from peers, prompt tokens computed) since the start."""
        stats = self.worker.engine.stats()
        return (stats.cached_tokens_by_tier or {}).get("remote", 0), stats.prompt_tokens_computed


@pytest.fixture(scope="module")
def model(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer random Llama (seeded) saved with SmolLM2's tokenizer: loads in a moment."""
    return tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]


@pytest.fixture(scope="module")
def uncached(model: str) -> LLMEngine:
    """The reference: the same model with prefix caching off."""
    return LLMEngine(EngineConfig(model, enable_prefix_caching=False, **ENGINE))


@pytest.fixture(scope="module")
def cluster(model: str) -> Iterator[tuple[Worker, Worker, Decode]]:
    server, address = start_store("127.0.0.1", SEALER.store_key())
    a, b = Worker("prefill-0", address, model), Worker("prefill-1", address, model)
    decode = Decode(address)
    yield a, b, decode
    for worker in (a, b):
        worker.worker.stop()
    decode.gate.stop()
    decode.ctx.destroy(linger=0)
    server.close()


def prefill(
    worker: Worker, decode: Decode, ids: list[int], peer: msg.PeerPrefix | None = None
) -> tuple[int, torch.Tensor]:
    """Send a Prefill as the API server would; the first token and the KV decode receives."""
    push = curve.client(decode.ctx.socket(zmq.PUSH), SEALER.curve_keys())
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(worker.addr)
    request_id = f"r-{next(_ids)}"
    push.send(SEALER.seal(msg.Prefill(request_id, ids, PARAMS, "decode-0", decode.addr, peer=peer)))
    push.close()
    header, kv = decode.receive()
    assert header.request_id == request_id
    return header.first_token, kv


def reference(engine: LLMEngine, ids: list[int]) -> tuple[int, torch.Tensor]:
    """First token and KV of the prompt computed with nothing cached."""
    request_id = f"ref-{next(_ids)}"
    engine.add_request(request_id, ids, PARAMS, prefill_only=True)
    while engine.has_unfinished_requests():
        engine.step()
    prefilled = engine.handoff.pop_prefilled(request_id)
    return prefilled.first_token, prefilled.kv.clone()


def prompt(tokenizer: Any, topic: str, question: str) -> list[int]:
    rules = " ".join(f"Rule {i} about {topic}: be brief." for i in range(10))
    return list(tokenizer.encode(f"{rules}\nQuestion: {question}"))


def check(result: tuple[int, torch.Tensor], expected: tuple[int, torch.Tensor]) -> None:
    assert result[0] == expected[0]
    assert torch.allclose(result[1], expected[1], atol=1e-4, rtol=1e-4)


def test_prefix_is_pulled_from_the_peer_and_only_the_rest_is_computed(
    cluster: Any, uncached: LLMEngine, smollm2_tokenizer: Any
) -> None:
    a, b, decode = cluster
    first = prompt(smollm2_tokenizer, "gardens", "Name a flower.")
    prefill(a, decode, first)
    second = prompt(smollm2_tokenizer, "gardens", "Name a tree, please.")
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y) // 16
    assert 4 <= common < len(block_hashes(first, 16, 0))
    before = b.remote_tokens()
    peer = msg.PeerPrefix("prefill-0", a.addr, common)
    result = prefill(b, decode, second, peer)
    after = b.remote_tokens()
    check(result, reference(uncached, second))
    assert after[0] - before[0] == common * 16
    assert after[1] - before[1] == len(second) - common * 16


def test_peer_with_fewer_blocks_than_named_sends_those_and_the_rest_is_computed(
    cluster: Any, uncached: LLMEngine, smollm2_tokenizer: Any
) -> None:
    a, b, decode = cluster
    first = prompt(smollm2_tokenizer, "rivers", "Name a river.")
    prefill(a, decode, first)
    second = prompt(smollm2_tokenizer, "rivers", "And now name a lake.")
    common = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y) // 16
    usable = (len(second) - 1) // 16
    before = b.remote_tokens()
    peer = msg.PeerPrefix("prefill-0", a.addr, usable)
    result = prefill(b, decode, second, peer)
    after = b.remote_tokens()
    check(result, reference(uncached, second))
    assert after[0] - before[0] == common * 16
    assert after[1] - before[1] == len(second) - common * 16


def test_peer_without_the_blocks_answers_none_and_the_prompt_is_computed(
    cluster: Any, uncached: LLMEngine, smollm2_tokenizer: Any
) -> None:
    a, b, decode = cluster
    ids = prompt(smollm2_tokenizer, "volcanoes", "Name one.")
    before = b.remote_tokens()
    peer = msg.PeerPrefix("prefill-0", a.addr, 4)
    result = prefill(b, decode, ids, peer)
    after = b.remote_tokens()
    check(result, reference(uncached, ids))
    assert after == (before[0], before[1] + len(ids))


def test_unreachable_peer_is_given_up_after_a_quarter_of_the_timeout_and_computed(
    cluster: Any, uncached: LLMEngine, smollm2_tokenizer: Any
) -> None:
    _, b, decode = cluster
    ids = prompt(smollm2_tokenizer, "owls", "Name one.")
    before = b.remote_tokens()
    peer = msg.PeerPrefix("prefill-7", f"tcp://127.0.0.1:{free_port()}", 4)
    start = time.monotonic()
    result = prefill(b, decode, ids, peer)
    elapsed = time.monotonic() - start
    check(result, reference(uncached, ids))
    assert b.remote_tokens() == (before[0], before[1] + len(ids))
    assert TIMEOUT_S / 4 <= elapsed < TIMEOUT_S


def test_garbage_on_a_request_socket_is_dropped_and_the_worker_keeps_serving(
    cluster: Any, uncached: LLMEngine, smollm2_tokenizer: Any
) -> None:
    a, _, decode = cluster
    push = curve.client(decode.ctx.socket(zmq.PUSH), SEALER.curve_keys())
    push.setsockopt(zmq.LINGER, 1000)
    push.connect(a.addr)
    push.send(b"\x93not msgpack of ours")
    push.send(msgpack.packb(["FetchBlocks", ["r", "x", "tcp://127.0.0.1:1", ["not a hash"]]]))
    push.close()
    ids = prompt(smollm2_tokenizer, "bread", "Name one.")
    check(prefill(a, decode, ids), reference(uncached, ids))
