"""Which prefix index a deployment names: the factory sits above the backends (index.py holds
the interface and the in-memory index, redis_index.py the Redis one)."""

from __future__ import annotations

from urllib.parse import urlparse

from splitserve.kvstore.index import DEFAULT_TTL_S, MemoryPrefixIndex, PrefixIndex
from splitserve.kvstore.redis_index import RedisPrefixIndex


def make_index(url: str, ttl_s: float = DEFAULT_TTL_S) -> PrefixIndex:
    """Build the index named by ``prefix_index.url``.

    ``memory://`` is this process's index. ``redis://[:password@]host:port/db`` and
    ``rediss://`` (TLS; certificates through redis-py's URL query parameters) reach Redis.
    """
    scheme = urlparse(url).scheme
    if scheme == "memory":
        return MemoryPrefixIndex(ttl_s)
    if scheme in ("redis", "rediss", "unix"):
        return RedisPrefixIndex(url, ttl_s)
    raise ValueError(f"prefix_index.url {url!r}: expected memory://, redis:// or rediss://")
