"""KVTransport between two real processes over gloo: order, dead peers, fresh generations."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from splitserve.kvstore.rendezvous import RendezvousClient, StoreAddress, start_store
from splitserve.kvstore.transfer import KVTransport, TransferError
from tests.support import processes
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
TIMEOUT_S = 20.0
KEY = b"transfer-test-key-0123456789abcdef"
SHAPES = [(2, 3, 1, 16, 3, 64), (2, 3, 4, 16, 3, 64), (2, 3, 2, 16, 3, 64)]


def _tensor(index: int, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.arange(int(torch.Size(shape).numel()), dtype=torch.float32).reshape(shape) + index


def _sender(store: StoreAddress, generation: int, count: int, results: Any) -> None:
    """Send the first ``count`` tensors; then wait to be killed if that is not all of them."""
    transport = KVTransport("p", store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    for index, shape in enumerate(SHAPES[:count]):
        transport.send("d", generation, _tensor(index, shape))
    results.put(transport.bytes_sent)
    if count < len(SHAPES):
        time.sleep(60)  # alive, holding the channel, until the test kills this process


def _start(store: StoreAddress, generation: int, count: int, results: Any) -> Any:
    ctx = processes.context()
    process = ctx.Process(target=_sender, args=(store, generation, count, results), daemon=True)
    process.start()
    return process


@pytest.fixture(scope="module")
def store() -> Any:
    server, address = start_store("127.0.0.1", KEY)
    yield address
    server.close()


def test_tensors_arrive_in_order_and_bytes_are_counted(store: StoreAddress) -> None:
    results = processes.context().Queue()
    sender = _start(store, 0, len(SHAPES), results)
    receiver = KVTransport("d", store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    for index, shape in enumerate(SHAPES):
        out = torch.empty(shape)
        receiver.recv("p", 0, out)
        assert torch.equal(out, _tensor(index, shape))
    expected = sum(torch.Size(s).numel() * 4 for s in SHAPES)
    assert receiver.bytes_received == expected
    assert results.get(timeout=TIMEOUT_S) == expected
    sender.join(timeout=TIMEOUT_S)


def test_dead_peer_is_a_transfer_error_then_a_new_generation_works(store: StoreAddress) -> None:
    ctx = processes.context()
    results = ctx.Queue()
    receiver = KVTransport("d", store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    doomed = _start(store, 1, 1, results)
    first = torch.empty(SHAPES[0])
    receiver.recv("p", 1, first)  # the channel is up
    results.get(timeout=TIMEOUT_S)
    doomed.kill()
    start = time.monotonic()
    with pytest.raises(TransferError):
        receiver.recv("p", 1, torch.empty(SHAPES[1]))
    assert time.monotonic() - start < TIMEOUT_S / 2
    receiver.drop("p", "d", 1)
    # A queue of its own: the killed sender may have died holding the first one's write lock
    # (its result read, the lock not yet released), and this sender's exit then waited for
    # that lock until the join below gave up (20 s, in 2 of 3 runs of the suite).
    sent = ctx.Queue()
    fresh = _start(store, 2, len(SHAPES), sent)
    for index, shape in enumerate(SHAPES):
        out = torch.empty(shape)
        receiver.recv("p", 2, out)
        assert torch.equal(out, _tensor(index, shape))
    assert sent.get(timeout=TIMEOUT_S) == sum(torch.Size(s).numel() * 4 for s in SHAPES)
    fresh.join(timeout=TIMEOUT_S)


def _both_ways(store: StoreAddress, me: str, other: str, results: Any) -> None:
    """Send to the other worker and receive from it at the same time, each on its own thread,
    with both channels still to be created (as two prefill workers pulling from each other)."""
    import threading

    transport = KVTransport(me, store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    got = torch.empty(4)
    threads = [
        threading.Thread(target=transport.send, args=(other, 5, torch.full((4,), float(len(me))))),
        threading.Thread(target=transport.recv, args=(other, 5, got)),
    ]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    results.put((me, got.tolist(), time.monotonic() - start))


def test_two_workers_sending_to_each_other_do_not_wait_on_each_other(store: StoreAddress) -> None:
    ctx = processes.context()
    results = ctx.Queue()
    workers = [
        ctx.Process(target=_both_ways, args=(store, me, other, results), daemon=True)
        for me, other in (("a", "bb"), ("bb", "a"))
    ]
    for process in workers:
        process.start()
    answers = {}
    for _ in workers:
        me, got, seconds = results.get(timeout=60)
        answers[me] = (got, seconds)
    for process in workers:
        process.join(timeout=10)
    assert answers["a"][0] == [2.0] * 4 and answers["bb"][0] == [1.0] * 4
    # A creation waiting, lock held, for a partner blocked on its own lock would only end at
    # the transport timeout (20 s here) with a TransferError.
    assert max(seconds for _, seconds in answers.values()) < TIMEOUT_S / 2


def _recv_then_send(store: StoreAddress, results: Any) -> None:
    """Worker "bb": receive from "a", and only then send back to it."""
    transport = KVTransport("bb", store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    got = torch.empty(4)
    transport.recv("a", 7, got)
    transport.send("a", 7, got * 10)
    results.put(got.tolist())


def test_a_channel_waiting_for_its_partner_does_not_hold_up_another_channel(
    store: StoreAddress,
) -> None:
    """In "a", the channel from "bb" starts forming first and waits: "bb" joins it only after
    it has received on the channel to "a", which forms second. Through one store connection
    for both (a store client serializes its calls) the second could not even publish its
    address until the first timed out."""
    import threading

    ctx = processes.context()
    results = ctx.Queue()
    partner = ctx.Process(target=_recv_then_send, args=(store, results), daemon=True)
    partner.start()
    transport = KVTransport("a", store, torch.device("cpu"), "gloo", TIMEOUT_S, key=KEY)
    keys = RendezvousClient(store, KEY)
    back = torch.empty(4)
    receiving = threading.Thread(target=transport.recv, args=("bb", 7, back))
    start = time.monotonic()
    receiving.start()
    wait_for(
        lambda: any(key.startswith("kv/bb->a/7/") for key in keys.list_keys()),
        TIMEOUT_S / 4,
        interval=0.01,
        message='"a" in the rendezvous store, waiting on the channel from "bb"',
    )
    transport.send("bb", 7, torch.full((4,), 3.0))
    receiving.join(timeout=TIMEOUT_S * 2)
    assert results.get(timeout=TIMEOUT_S) == [3.0] * 4
    assert back.tolist() == [30.0] * 4
    assert time.monotonic() - start < TIMEOUT_S / 2
    partner.join(timeout=10)
