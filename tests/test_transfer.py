"""KVTransport between two real processes over gloo: order, dead peers, fresh generations."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Any

import pytest
import torch

from splitserve.kvstore.transfer import KVTransport, StoreAddress, TransferError, start_store

pytestmark = pytest.mark.slow
TIMEOUT_S = 20.0
SHAPES = [(2, 3, 1, 16, 3, 64), (2, 3, 4, 16, 3, 64), (2, 3, 2, 16, 3, 64)]


def _tensor(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape) + index


def _sender(store: StoreAddress, generation: int, count: int, results: Any) -> None:
    """Send the first ``count`` tensors; then wait to be killed if that is not all of them."""
    transport = KVTransport("p", store, torch.device("cpu"), "gloo", TIMEOUT_S)
    for index, shape in enumerate(SHAPES[:count]):
        transport.send("d", generation, _tensor(index, shape))
    results.put(transport.bytes_sent)
    if count < len(SHAPES):
        time.sleep(60)


def _spawn(store: StoreAddress, generation: int, count: int, results: Any) -> Any:
    ctx = mp.get_context("spawn")
    process = ctx.Process(target=_sender, args=(store, generation, count, results), daemon=True)
    process.start()
    return process


@pytest.fixture(scope="module")
def store() -> Any:
    server, address = start_store("127.0.0.1")
    yield address
    del server


def test_tensors_arrive_in_order_and_bytes_are_counted(store: StoreAddress) -> None:
    results = mp.get_context("spawn").Queue()
    sender = _spawn(store, 0, len(SHAPES), results)
    receiver = KVTransport("d", store, torch.device("cpu"), "gloo", TIMEOUT_S)
    for index, shape in enumerate(SHAPES):
        out = torch.empty(shape)
        receiver.recv("p", 0, out)
        assert torch.equal(out, _tensor(index, shape))
    expected = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    assert receiver.bytes_received == expected
    assert results.get(timeout=TIMEOUT_S) == expected
    sender.join(timeout=TIMEOUT_S)


def test_dead_peer_is_a_transfer_error_then_a_new_generation_works(store: StoreAddress) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    receiver = KVTransport("d", store, torch.device("cpu"), "gloo", TIMEOUT_S)
    doomed = _spawn(store, 1, 1, results)
    first = torch.empty(SHAPES[0])
    receiver.recv("p", 1, first)  # the channel is up
    results.get(timeout=TIMEOUT_S)
    doomed.kill()
    start = time.monotonic()
    with pytest.raises(TransferError):
        receiver.recv("p", 1, torch.empty(SHAPES[1]))
    assert time.monotonic() - start < TIMEOUT_S / 2
    receiver.drop("p", "d", 1)
    fresh = _spawn(store, 2, len(SHAPES), results)
    for index, shape in enumerate(SHAPES):
        out = torch.empty(shape)
        receiver.recv("p", 2, out)
        assert torch.equal(out, _tensor(index, shape))
    fresh.join(timeout=TIMEOUT_S)
