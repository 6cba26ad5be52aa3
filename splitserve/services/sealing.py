"""HMAC on every internal message: a per-deployment secret that only the launcher, the API
server and the workers hold.

On the wire a sealed message is ``tag + body``: ``body`` is the msgpack form of
services/messages.py, ``tag`` its HMAC-SHA256 under the secret (32 bytes). ``unseal`` checks
the tag in constant time before a byte of the body is parsed, so a process that can reach an
internal port but does not hold the secret can neither submit work (a GenerateRequest, a
FetchBlocks asking for a peer's KV) nor feed the API server outputs. Messages stay msgpack:
nothing on a socket is ever unpickled.

What this does not give: confidentiality (prompts and tokens cross the internal network in
clear text) and replay protection (a message captured on the wire can be sent again).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
from dataclasses import dataclass, field

from splitserve.curve import CurveKeys
from splitserve.services import messages as msg

TAG_BYTES = 32
SECRET_BYTES = 32


class Forged(ValueError):
    """A message whose tag is missing or does not match: not from this deployment."""


def _new_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


@dataclass(frozen=True)
class Sealer:
    """Seals and checks messages under one deployment's secret (a fresh random one unless
    given: a worker spec built without the launcher's secret talks to nobody else)."""

    secret: bytes = field(default_factory=_new_secret, repr=False)

    def __post_init__(self) -> None:
        if len(self.secret) < 16:
            raise ValueError("the internal secret must be at least 16 bytes")

    def seal(self, message: msg.Message) -> bytes:
        body = msg.encode(message)
        return self._tag(body) + body

    def unseal(self, data: bytes) -> msg.Message:
        """The message, if its tag is right; Forged if not, ValueError if it does not decode."""
        return msg.decode(self.check(data))

    def check(self, data: bytes) -> bytes:
        """The body (still msgpack), if its tag is right; Forged if not."""
        tag, body = data[:TAG_BYTES], data[TAG_BYTES:]
        if len(data) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(body)):
            raise Forged("its HMAC is missing or wrong")
        return body

    def _tag(self, body: bytes) -> bytes:
        return hmac.new(self.secret, body, hashlib.sha256).digest()

    def curve_keys(self) -> CurveKeys:
        """The deployment's CurveZMQ key pair, derived from the secret (splitserve/curve.py)."""
        return CurveKeys.derive(self.secret)

    def store_key(self) -> bytes:
        """The key that signs the transfer rendezvous store's values (kvstore/signed_store.py),
        derived from the secret."""
        return hmac.new(self.secret, b"rendezvous", hashlib.sha256).digest()


class Rejections:
    """Messages dropped as forged: counted, the first and then every ``log_every``-th logged
    (a flood of them must not flood the log)."""

    def __init__(self, logger: logging.Logger, where: str, log_every: int = 1000) -> None:
        self.count = 0
        self._logger = logger
        self._where = where
        self._log_every = log_every

    def add(self, reason: Forged) -> None:
        self.count += 1
        if self.count == 1 or self.count % self._log_every == 0:
            self._logger.warning(
                "%s: dropped a message that is not from this deployment (%s); %d so far",
                self._where,
                reason,
                self.count,
            )
