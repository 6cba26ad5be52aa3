"""The KV transport's rendezvous store: a small key-value server that the launcher hosts and
every worker's channels meet through (kvstore/transfer.py), over CurveZMQ (splitserve/curve.py).

It replaces torch's TCPStore, which has no authentication and listens on every interface
whatever host it is given: anyone who reached it could list the workers' keys and addresses and
delete them. This one binds only ``host`` (server.internal_host) and admits only clients that
hold the deployment's store key (a ZAP gate; everything on the wire is encrypted); a client
without it never completes a handshake, so its requests go unanswered until its timeout.

Requests are ZMQ multipart messages ``[request id, op, *args]`` on a DEALER socket, answered
``[request id, *result]`` by the server's ROUTER: ``get`` and ``wait`` are answered once their
keys exist, so a client waits on its own socket, with its own timeout, and one waiting client
never holds up another. Values stay in memory until the server closes.
"""

from __future__ import annotations

import datetime
import itertools
import threading
import weakref
from dataclasses import dataclass

import zmq

from splitserve import curve

POLL_MS = 100
MAX_REQUEST_BYTES = 1 << 16
"""Rendezvous values are listening addresses and NCCL unique ids (about 100 bytes each)."""
DEFAULT_TIMEOUT = datetime.timedelta(seconds=30)


@dataclass(frozen=True)
class StoreAddress:
    host: str
    port: int


def store_keys(key: bytes) -> curve.CurveKeys:
    return curve.CurveKeys.derive(key, b"rendezvous")


@dataclass
class _Waiter:
    peer: bytes
    request_id: bytes
    op: bytes
    keys: list[bytes]


class RendezvousServer:
    """Serves the store on a free port of ``host`` from a thread of its own until ``close``."""

    def __init__(self, host: str, key: bytes) -> None:
        keys = store_keys(key)
        self._ctx = zmq.Context()
        self.gate = curve.Gate(self._ctx, keys)
        self._socket = curve.server(self._ctx.socket(zmq.ROUTER), keys)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        self.address = StoreAddress(host, self._socket.bind_to_random_port(f"tcp://{host}"))
        self.endpoint: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._values: dict[bytes, bytes] = {}
        self._waiting: list[_Waiter] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="rendezvous", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        self.gate.stop()
        self._ctx.destroy(linger=0)

    def _serve(self) -> None:
        while not self._stop.is_set():
            if not self._socket.poll(POLL_MS):
                continue
            frames = self._socket.recv_multipart()
            if len(frames) < 3:
                continue  # not a request: dropped
            peer, request_id, op, args = frames[0], frames[1], frames[2], frames[3:]
            try:
                self._answer(peer, request_id, op, args)
            except (ValueError, IndexError):
                self._reply(peer, request_id, b"error", b"malformed request")

    def _answer(self, peer: bytes, request_id: bytes, op: bytes, args: list[bytes]) -> None:
        values = self._values
        if op == b"set":
            values[args[0]] = args[1]
            self._reply(peer, request_id, b"ok")
            self._wake()
        elif op == b"add":
            total = int(values.get(args[0], b"0")) + int(args[1])
            values[args[0]] = str(total).encode()
            self._reply(peer, request_id, b"ok", values[args[0]])
            self._wake()
        elif op in (b"get", b"wait"):
            self._waiting.append(_Waiter(peer, request_id, op, args[:1] if op == b"get" else args))
            self._wake()
        elif op == b"check":
            self._reply(peer, request_id, b"ok", b"1" if all(k in values for k in args) else b"0")
        elif op == b"delete":
            self._reply(peer, request_id, b"ok", b"1" if values.pop(args[0], None) else b"0")
        elif op == b"count":
            self._reply(peer, request_id, b"ok", str(len(values)).encode())
        elif op == b"keys":
            self._reply(peer, request_id, b"ok", *values)
        else:
            self._reply(peer, request_id, b"error", b"unknown op")

    def _wake(self) -> None:
        """Answer every waiting get and wait whose keys now exist."""
        still = []
        for waiter in self._waiting:
            if all(k in self._values for k in waiter.keys):
                result = [self._values[waiter.keys[0]]] if waiter.op == b"get" else []
                self._reply(waiter.peer, waiter.request_id, b"ok", *result)
            else:
                still.append(waiter)
        self._waiting = still

    def _reply(self, peer: bytes, request_id: bytes, *frames: bytes) -> None:
        self._socket.send_multipart([peer, request_id, *frames])


def start_store(host: str, key: bytes) -> tuple[RendezvousServer, StoreAddress]:
    """Host the rendezvous store on a free port of ``host``, for the holders of ``key`` (the
    deployment's store key); ``close`` the returned server when done."""
    server = RendezvousServer(host, key)
    return server, server.address


class RendezvousTimeout(RuntimeError):
    """The store did not answer in time: not there, or this process lacks the store key."""


class RendezvousClient:
    """One connection to the store; thread-safe (one request at a time). The calls are the
    ones kvstore/signed_store.py makes of the store it wraps."""

    def __init__(
        self, address: StoreAddress, key: bytes, timeout: datetime.timedelta = DEFAULT_TIMEOUT
    ) -> None:
        self._address = address
        self._timeout = timeout
        self._lock = threading.Lock()
        self._ids = itertools.count()
        socket: zmq.Socket = curve.client(
            zmq.Context.instance().socket(zmq.DEALER), store_keys(key)
        )
        socket.setsockopt(zmq.LINGER, 0)
        socket.connect(f"tcp://{address.host}:{address.port}")
        self._socket = socket
        weakref.finalize(self, socket.close, 0)

    def set(self, key: str, value: bytes) -> None:
        self._call(b"set", key.encode(), value)

    def get(self, key: str) -> bytes:
        return self._call(b"get", key.encode())[0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call(b"add", key.encode(), str(amount).encode())[0])

    def check(self, keys: list[str]) -> bool:
        return self._call(b"check", *(k.encode() for k in keys))[0] == b"1"

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._call(b"wait", *(k.encode() for k in keys), timeout=timeout)

    def delete_key(self, key: str) -> bool:
        return self._call(b"delete", key.encode())[0] == b"1"

    def num_keys(self) -> int:
        return int(self._call(b"count")[0])

    def list_keys(self) -> list[str]:
        return [k.decode() for k in self._call(b"keys")]

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._timeout = timeout

    def _call(
        self, op: bytes, *args: bytes, timeout: datetime.timedelta | None = None
    ) -> list[bytes]:
        seconds = (timeout or self._timeout).total_seconds()
        with self._lock:
            request_id = str(next(self._ids)).encode()
            self._socket.send_multipart([request_id, op, *args])
            while self._socket.poll(int(seconds * 1000)):
                reply = self._socket.recv_multipart()
                if reply[0] != request_id:
                    continue  # the late answer to a request that timed out
                if reply[1] != b"ok":
                    raise RuntimeError(f"rendezvous store: {reply[2].decode()}")
                return reply[2:]
        address = f"{self._address.host}:{self._address.port}"
        raise RendezvousTimeout(
            f"the rendezvous store at {address} did not answer {op.decode()} within "
            f"{seconds:g} s (not there, or this process lacks the deployment's key)"
        )
