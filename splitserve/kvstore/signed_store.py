"""The transfer rendezvous store with every value signed: a c10d Store over the TCPStore that
the service hosts (kvstore/transfer.py) which HMACs each value it sets under the deployment's
key and refuses, on get, a value whose tag is missing or wrong.

The TCPStore has no authentication of its own and, in cluster mode, listens on the node's
address, where workers of other nodes reach it. What a channel's two ranks exchange through it
(gloo's listening addresses, NCCL's unique id) decides who they connect to: unsigned, anyone
who reaches the port could put their own address there and take a prompt's KV or feed a decode
worker theirs. Signed, such a value fails the channel (TransferError: the request fails and the
next generation starts afresh) instead of being used.

What this does not give: secrecy of the values (a client of the store can read them, through
``list_keys``) nor protection against deleting or flooding keys (denial of service).

NOTE: torch's PrefixStore cannot wrap a Python store (its calls into it are not implemented),
so the key prefix is applied here.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
from typing import Any

import torch.distributed as dist

TAG_BYTES = 32


class ForgedValue(RuntimeError):
    """A rendezvous value without this deployment's signature."""


class SignedStore(dist.Store):
    """Keys under ``prefix``; values as ``tag + value``, the tag an HMAC-SHA256 of the full
    key and the value under ``key``."""

    def __init__(self, inner: Any, key: bytes, prefix: str) -> None:
        super().__init__()
        self._inner = inner
        self._key = key
        self._prefix = prefix

    def set(self, key: str, value: Any) -> None:
        full, data = self._full(key), _as_bytes(value)
        self._inner.set(full, self._tag(full, data) + data)

    def get(self, key: str) -> bytes:
        full = self._full(key)
        stored = bytes(self._inner.get(full))
        tag, data = stored[:TAG_BYTES], stored[TAG_BYTES:]
        if len(stored) < TAG_BYTES or not hmac.compare_digest(tag, self._tag(full, data)):
            raise ForgedValue(f"the rendezvous value of {full!r} is not signed by this deployment")
        return data

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        full = [self._full(k) for k in keys]
        if timeout is None:
            self._inner.wait(full)
        else:
            self._inner.wait(full, timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._inner.check([self._full(k) for k in keys]))

    def add(self, key: str, amount: int) -> int:
        return int(self._inner.add(self._full(key), amount))

    def delete_key(self, key: str) -> bool:
        return bool(self._inner.delete_key(self._full(key)))

    def num_keys(self) -> int:
        return int(self._inner.num_keys())

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._inner.set_timeout(timeout)

    def _full(self, key: str) -> str:
        return f"{self._prefix}/{key}"

    def _tag(self, full: str, data: bytes) -> bytes:
        return hmac.new(self._key, full.encode() + b"\0" + data, hashlib.sha256).digest()


def _as_bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)
