"""The KV transport's rendezvous store (kvstore/rendezvous.py) binds only the internal host and
answers only clients that hold the deployment's store key (issue 48, finding 5: torch's
TCPStore listened on every interface, and anyone who reached it could list and delete keys)."""

from __future__ import annotations

import datetime
import socket
import threading
from collections.abc import Iterator

import psutil
import pytest
import zmq

from splitserve.kvstore.rendezvous import (
    RendezvousClient,
    RendezvousServer,
    RendezvousTimeout,
    start_store,
    store_keys,
)

KEY = b"deployment-store-key-0123456789ab"
SHORT = datetime.timedelta(seconds=0.5)


@pytest.fixture()
def server() -> Iterator[RendezvousServer]:
    server, _ = start_store("127.0.0.1", KEY)
    yield server
    server.close()


def non_loopback_addresses() -> list[str]:
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def test_the_store_listens_on_the_internal_host_only(server: RendezvousServer) -> None:
    port = server.address.port
    assert server.endpoint == f"tcp://127.0.0.1:{port}"
    with socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    others = non_loopback_addresses()
    if not others:
        pytest.skip("this host has no address but loopback")
    for address in others:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection((address, port), timeout=2).close()


def test_holders_of_the_key_set_get_add_wait_check_and_delete(server: RendezvousServer) -> None:
    a, b = RendezvousClient(server.address, KEY), RendezvousClient(server.address, KEY)
    waited: list[bytes] = []
    getter = threading.Thread(target=lambda: waited.append(b.get("late")))
    getter.start()  # answered once the key exists
    a.set("late", b"10.0.0.1:5000")
    getter.join(timeout=5)
    assert waited == [b"10.0.0.1:5000"]
    assert (a.add("n", 2), b.add("n", 3), a.get("n")) == (2, 5, b"5")
    b.wait(["late", "n"])
    assert (a.check(["late", "n"]), a.check(["late", "missing"])) == (True, False)
    assert sorted(a.list_keys()) == ["late", "n"] and a.num_keys() == 2
    assert (a.delete_key("late"), a.delete_key("late"), a.num_keys()) == (True, False, 1)
    with pytest.raises(RendezvousTimeout, match=r"did not answer wait within 0\.5 s"):
        a.wait(["missing"], SHORT)


def test_a_client_without_the_key_is_refused_and_changes_nothing(
    server: RendezvousServer,
) -> None:
    member = RendezvousClient(server.address, KEY)
    member.set("kv/p->d/0/rank_0", b"10.0.0.1:5000")
    intruder = RendezvousClient(server.address, b"not-the-deployment-key-0123456789", SHORT)
    for call in (
        intruder.list_keys,
        lambda: intruder.delete_key("kv/p->d/0/rank_0"),
        lambda: intruder.set("kv/p->d/0/rank_0", b"10.6.6.6:4000"),
    ):
        with pytest.raises(RendezvousTimeout, match="lacks the deployment's key"):
            call()
    assert member.list_keys() == ["kv/p->d/0/rank_0"]
    assert member.get("kv/p->d/0/rank_0") == b"10.0.0.1:5000"


def test_knowing_the_servers_public_key_is_not_enough(server: RendezvousServer) -> None:
    """A client with a key pair of its own that learnt the server's public key completes the
    encryption but not the authentication: the gate refuses it."""
    ctx = zmq.Context()
    rogue = ctx.socket(zmq.DEALER)
    public, secret = zmq.curve_keypair()
    rogue.curve_serverkey = store_keys(KEY).public
    rogue.curve_publickey, rogue.curve_secretkey = public, secret
    rogue.connect(f"tcp://127.0.0.1:{server.address.port}")
    rogue.send_multipart([b"1", b"keys"])
    try:
        assert not rogue.poll(500)
        assert server.gate.refused >= 1
    finally:
        ctx.destroy(linger=0)
