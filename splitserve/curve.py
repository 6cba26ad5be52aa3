"""CurveZMQ on every internal socket: the deployment's key pair, and the gate that admits only
the processes that hold it.

The launcher makes one random secret per deployment (services/sealing.py: ``Sealer``) and
hands it to the API server and, inside each worker's spec, to the workers (Ray carries the
spec on its control plane; the secret never crosses a ZMQ socket). Every process derives the
same Curve25519 key pair from it (``CurveKeys.derive``). A socket that binds is a CURVE server
with that pair, and its context's ``Gate`` (a ZAP handler) admits a connecting peer only when
the peer proved, in the handshake, that it holds the pair's secret key; a socket that connects
is a CURVE client with the same pair. So a process without the secret cannot finish a
handshake: it can neither read a worker's output (a PUSH socket never counts it as a peer) nor
send anything, and everything on the wire is encrypted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
from dataclasses import dataclass, field
from typing import TypeVar

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

DOMAIN = "splitserve"
S = TypeVar("S", bound=zmq.Socket)
logger = logging.getLogger("splitserve.curve")


@dataclass(frozen=True)
class CurveKeys:
    """A Curve25519 key pair in Z85 text (40 bytes each), as libzmq takes them."""

    public: bytes = field(repr=False)
    secret: bytes = field(repr=False)

    @classmethod
    def derive(cls, secret: bytes, purpose: bytes = b"sockets") -> CurveKeys:
        """The pair that every holder of ``secret`` derives alike (a different ``purpose``
        gives an unrelated pair)."""
        seed = hmac.new(secret, b"curve/" + purpose, hashlib.sha256).digest()
        private = z85.encode(seed)
        return cls(zmq.curve_public(private), private)


class Gate:
    """The ZAP handler of one ZMQ context: its CURVE server sockets admit a client only if the
    client's public key is the deployment's. Start it before the context's sockets bind, stop
    it before the context is destroyed. ``refused`` counts the handshakes it turned down."""

    def __init__(self, ctx: zmq.Context, keys: CurveKeys) -> None:
        self._public = keys.public
        self._lock = threading.Lock()
        self.refused = 0
        # A synchronous view of the same libzmq context: the handler's thread needs blocking
        # sockets, and a zmq.asyncio.Context would give it asyncio ones.
        self._auth = ThreadAuthenticator(zmq.Context.shadow(ctx.underlying), log=logger)
        self._auth.start()
        self._auth.configure_curve_callback(DOMAIN, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """pyzmq's credentials-provider hook: is this client one of the deployment's?"""
        admitted = hmac.compare_digest(client_key, self._public)
        if not admitted:
            with self._lock:
                self.refused += 1
                count = self.refused
            if count == 1 or count % 1000 == 0:
                logger.warning("refused %d connections without the deployment's key", count)
        return admitted

    def stop(self) -> None:
        self._auth.stop()


def server(socket: S, keys: CurveKeys) -> S:
    """Make ``socket`` (before it binds) a CURVE server that its context's Gate guards."""
    socket.curve_secretkey = keys.secret
    socket.curve_publickey = keys.public
    socket.curve_server = True
    socket.zap_domain = DOMAIN.encode()
    return socket


def client(socket: S, keys: CurveKeys) -> S:
    """Make ``socket`` (before it connects) a CURVE client of the deployment's servers."""
    socket.curve_serverkey = keys.public
    socket.curve_publickey = keys.public
    socket.curve_secretkey = keys.secret
    return socket
