"""The prefix index in Redis, shared by every router and worker of a deployment.

Layout: one hash key per block, ``{namespace}:b:{block hash as 16 hex digits}``, whose fields
are ``holder@tier`` and whose values are the publish time (Unix seconds). Every store refreshes
the key's TTL; a field older than ``ttl_s`` is ignored on lookup, so each (block, holder, tier)
entry expires ``ttl_s`` after its last publish even when other holders keep the key alive.

Failure model: any Redis error marks the index unhealthy for ``retry_interval_s``; meanwhile
lookups answer {} (the router falls back to load only) and publishes are dropped. Because
entries may have been lost (a restart without persistence, evictions dropped while away),
``epoch`` changes on every failure and whenever the marker key shows that Redis was reset;
writers watch it and ``rebuild`` their holdings (PublishBuffer does).

Malformed data (a field that is not UTF-8, a time that is not a finite number, a block key
that is not a hash) is skipped where it is met and counted (``malformed_entries``): the rest of
the block, and the rest of the lookup, still count, and no lookup fails for it.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from splitserve.kvstore.index import TIER_RANK, TIERS, Prefixes, PrefixIndex, PrefixScan, check_tier

log = logging.getLogger(__name__)
_ERRORS = (redis.RedisError, OSError)


class RedisPrefixIndex(PrefixIndex):
    """PrefixIndex over redis-py; every call is one or a few pipelined round trips."""

    def __init__(
        self,
        url: str,
        ttl_s: float,
        namespace: str = "splitserve:kv",
        timeout_s: float = 0.25,
        retry_interval_s: float = 1.0,
        first_chunk: int = 32,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._client: redis.Redis = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry=Retry(NoBackoff(), 0),
        )
        self._ttl_s = ttl_s
        self._key_ttl = max(1, int(ttl_s + 0.999))
        self._ns = namespace
        self._retry_interval_s = retry_interval_s
        self._first_chunk = first_chunk
        self._clock = clock
        self._healthy = True
        self._down_until = 0.0
        self._next_probe = 0.0
        self._epoch = 0
        self._marker: bytes | None = None
        self._malformed = 0

    def publish(
        self, holder: str, tier: str, stored: Sequence[int], evicted: Sequence[int]
    ) -> None:
        check_tier(tier)
        if not self._available():
            return
        field = f"{holder}@{tier}"
        now = repr(self._clock())
        pipe = self._client.pipeline(transaction=False)
        for block_hash in stored:
            key = self._key(block_hash)
            pipe.hset(key, field, now)
            pipe.expire(key, self._key_ttl)
        for block_hash in evicted:
            pipe.hdel(self._key(block_hash), field)
        self._run(pipe.execute)

    def longest_prefixes(self, block_hashes: Sequence[int]) -> Prefixes:
        if not self._available():
            return {}
        scan = PrefixScan()
        oldest = self._clock() - self._ttl_s
        start, size = 0, self._first_chunk
        while start < len(block_hashes):
            replies = self._hgetall(block_hashes[start : start + size])
            if replies is None:
                return {}
            for fields in replies:
                if not scan.add_block(self._best_tiers(fields, oldest)):
                    return scan.result
            start, size = start + size, size * 2
        return scan.result

    def rebuild(self, holder: str, tier: str, block_hashes: Iterable[int]) -> None:
        check_tier(tier)
        if self._strip_fields([f"{holder}@{tier}"]):
            self.publish(holder, tier, list(block_hashes), ())

    def drop_holder(self, holder: str) -> None:
        self._strip_fields([f"{holder}@{tier}" for tier in TIERS])

    def healthy(self) -> bool:
        """The last known state; probes Redis (and checks for a reset) at most once a second."""
        now = time.monotonic()
        if now >= max(self._next_probe, self._down_until):
            self._next_probe = now + self._retry_interval_s
            self._probe()
        return self._healthy

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def malformed_entries(self) -> int:
        return self._malformed

    def close(self) -> None:
        self._client.close()

    def _key(self, block_hash: int) -> str:
        return f"{self._ns}:b:{block_hash:016x}"

    def _hgetall(self, block_hashes: Sequence[int]) -> list[dict[bytes, bytes]] | None:
        """Each block's fields; a key that is not a hash (WRONGTYPE) counts as malformed and
        as no fields."""
        pipe = self._client.pipeline(transaction=False)
        for block_hash in block_hashes:
            pipe.hgetall(self._key(block_hash))
        ok, replies = self._run(lambda: pipe.execute(raise_on_error=False))
        if not ok:
            return None
        failed = [reply for reply in replies if isinstance(reply, redis.ResponseError)]
        self._count_malformed(len(failed))
        return [{} if isinstance(reply, redis.ResponseError) else reply for reply in replies]

    def _best_tiers(self, fields: dict[bytes, bytes], oldest: float) -> dict[str, int]:
        """holder -> fastest tier rank among the block's well-formed fields published after
        ``oldest``."""
        best: dict[str, int] = {}
        malformed = 0
        for raw_field, raw_time in fields.items():
            try:
                published = float(raw_time)
                holder, _, tier = raw_field.decode().rpartition("@")
            except (ValueError, UnicodeDecodeError):
                malformed += 1
                continue
            if not math.isfinite(published):
                malformed += 1
                continue
            rank = TIER_RANK.get(tier)
            if published >= oldest and rank is not None and rank < best.get(holder, len(TIERS)):
                best[holder] = rank
        self._count_malformed(malformed)
        return best

    def _count_malformed(self, count: int) -> None:
        if count and not self._malformed:
            log.warning("prefix index: malformed entries in Redis, skipped (counted from now)")
        self._malformed += count

    def _strip_fields(self, fields: list[str]) -> bool:
        """Remove ``fields`` from every block key; False when Redis could not be reached."""
        if not self._available():
            return False

        def strip() -> None:
            keys = self._client.scan_iter(match=f"{self._ns}:b:*", count=1000)
            pipe = self._client.pipeline(transaction=False)
            for count, key in enumerate(keys, 1):
                pipe.hdel(key, *fields)
                if count % 1000 == 0:
                    pipe.execute()
            pipe.execute()

        return self._run(strip)[0]

    def _probe(self) -> None:
        """Check reachability and whether Redis lost its data since we last looked."""
        marker_key = f"{self._ns}:marker"
        pipe = self._client.pipeline(transaction=False)
        pipe.set(marker_key, uuid.uuid4().hex, nx=True)
        pipe.get(marker_key)
        ok, replies = self._run(pipe.execute)
        if not ok:
            return
        marker = replies[1]
        if self._marker is not None and marker != self._marker:
            log.warning("prefix index: Redis was reset; writers will rebuild")
            self._epoch += 1
        self._marker = marker

    def _available(self) -> bool:
        return self._healthy or time.monotonic() >= self._down_until

    def _run(self, call: Callable[[], Any]) -> tuple[bool, Any]:
        try:
            result = call()
        except _ERRORS as exc:
            if self._healthy:
                log.warning("prefix index: Redis unreachable (%s); routing by load only", exc)
                self._epoch += 1
            self._healthy = False
            self._down_until = time.monotonic() + self._retry_interval_s
            return False, None
        if not self._healthy:
            log.warning("prefix index: Redis is back")
            self._healthy = True
            self._next_probe = 0.0
        return True, result
