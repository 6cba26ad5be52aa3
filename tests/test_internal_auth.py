"""Internal traffic is authenticated by the deployment's secret (issue 16): every ZMQ message
carries an HMAC (services/sealing.py) and every transfer rendezvous value a signature
(kvstore/signed_store.py). A real EngineWorker (its loop and sockets, without Ray) on a tiny
random Llama drops what is not sealed with its secret, counts and logs it, and keeps serving;
a rendezvous value without the signature is never used. (Who may connect at all: CurveZMQ,
tests/test_internal_sockets.py and tests/test_rendezvous.py.)"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from splitserve.engine.request import SamplingParams
from splitserve.kvstore.rendezvous import RendezvousClient, StoreAddress, start_store
from splitserve.kvstore.signed_store import ForgedValue, SignedStore
from splitserve.kvstore.transfer import KVTransport, TransferError
from splitserve.services import messages as msg
from splitserve.services.sealing import TAG_BYTES, Forged, Sealer
from splitserve.services.workers.engine_worker import EngineWorker
from tests.support.tiny_models import tiny_model
from tests.support.worker_sockets import ApiEnd, colocated_worker

pytestmark = pytest.mark.slow
ENGINE = {"kv_cache_bytes": 16 << 20, "max_model_len": 512}
GREEDY = SamplingParams(temperature=0.0, max_tokens=2)
TIMEOUT_S = 10.0


def test_a_sealed_message_opens_only_under_its_own_secret_and_untouched() -> None:
    sealer = Sealer(b"k" * 32)
    message = msg.AbortRequest(["a", "b"])
    sealed = sealer.seal(message)
    assert len(sealed) == TAG_BYTES + len(msg.encode(message))
    assert sealer.unseal(sealed) == message
    tampered = bytearray(sealed)
    tampered[-1] ^= 1
    for bad in (msg.encode(message), Sealer(b"x" * 32).seal(message), bytes(tampered), b""):
        with pytest.raises(Forged, match="its HMAC is missing or wrong"):
            sealer.unseal(bad)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        Sealer(b"short")
    assert Sealer().secret != Sealer().secret  # a fresh random secret per deployment


@pytest.fixture(scope="module")
def worker(
    smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[EngineWorker, ApiEnd]]:
    model = tiny_model(smollm2_tokenizer, tmp_path_factory.mktemp("tiny-llama"))[1]
    with colocated_worker(model, **ENGINE) as started:
        yield started


def test_a_worker_drops_messages_without_its_hmac_counts_them_and_keeps_serving(
    worker: tuple[EngineWorker, ApiEnd], caplog: pytest.LogCaptureFixture
) -> None:
    """Before: any process that reached the request port could make the worker generate."""
    engine_worker, api = worker
    prompt = list(range(100, 120))
    with caplog.at_level(logging.WARNING, logger="splitserve.worker"):
        api.push.send(msg.encode(msg.GenerateRequest("unsealed", prompt, GREEDY)))
        api.push.send(Sealer().seal(msg.GenerateRequest("other-key", prompt, GREEDY)))
        api.push.send(b"\x00" * 40)
        api.send(msg.GenerateRequest("sealed", prompt, GREEDY))
        api.wait("the sealed request's tokens", lambda: "sealed" in api.finished, 30)
    assert len(api.tokens["sealed"]) == 2
    assert sorted(api.tokens) == ["sealed"] and api.errors == {}
    assert engine_worker.rejected.count == 3
    assert [r.getMessage() for r in caplog.records] == [
        "worker both-0: dropped a message that is not from this deployment "
        "(its HMAC is missing or wrong); 1 so far"
    ]


KEY = b"k" * 32


@pytest.fixture(scope="module")
def store() -> Iterator[StoreAddress]:
    server, address = start_store("127.0.0.1", KEY)
    yield address
    server.close()


def test_transports_with_the_key_connect_through_signed_rendezvous_values(
    store: StoreAddress,
) -> None:
    errors: list[BaseException] = []
    received = torch.zeros(4)

    def side(name: str) -> None:
        transport = KVTransport(name, store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
        try:
            if name == "p":
                transport.send("d", 0, torch.arange(4.0))
            else:
                transport.recv("p", 0, received)
        except TransferError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=side, args=name) for name in "pd"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT_S * 2)
    assert errors == [] and received.tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_value_set_without_the_signature_is_refused(store: StoreAddress) -> None:
    """Defence in depth behind the store's own gate: a value that a client of the store set
    without the signature (a bug, or a leaked store key) is never used as an address."""
    raw = RendezvousClient(store, KEY)
    signed = SignedStore(raw, KEY, "kv/x->y/0")
    raw.set("kv/x->y/0/rank_0", b"10.0.0.66:4000")
    with pytest.raises(ForgedValue, match="'kv/x->y/0/rank_0' is not signed by this deployment"):
        signed.get("rank_0")
    signed.set("rank_1", b"10.0.0.1:5000")
    assert signed.get("rank_1") == b"10.0.0.1:5000"
    assert raw.get("kv/x->y/0/rank_1")[TAG_BYTES:] == b"10.0.0.1:5000"
