"""PrefixIndex: both backends through one suite, then Redis outages, auth and PublishBuffer."""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from splitserve.kvstore.hashing import block_hashes
from splitserve.kvstore.index import MemoryPrefixIndex, PrefixIndex
from splitserve.kvstore.index_backends import make_index
from splitserve.kvstore.publish import PublishBuffer
from splitserve.kvstore.redis_index import RedisPrefixIndex
from tests.support.hung_listener import hung_listener
from tests.support.redis_process import RedisProcess

H = block_hashes(list(range(64)), 16, 0)  # four chained blocks
TTL_S = 100.0


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


IndexFactory = Callable[..., PrefixIndex]


@pytest.fixture(params=["memory", "redis"])
def make(request: pytest.FixtureRequest) -> Iterator[IndexFactory]:
    made: list[PrefixIndex] = []

    def build(clock: FakeClock | None = None) -> PrefixIndex:
        clock = clock or FakeClock()
        if request.param == "memory":
            index: PrefixIndex = MemoryPrefixIndex(TTL_S, clock=clock)
        else:
            server = request.getfixturevalue("redis_server")
            namespace = f"test:{uuid.uuid4().hex}"
            index = RedisPrefixIndex(server.url, TTL_S, namespace=namespace, clock=clock)
        made.append(index)
        return index

    yield build
    for index in made:
        index.close()


def test_longest_prefix_per_holder_stops_at_its_first_missing_block(make: IndexFactory) -> None:
    index = make()
    index.publish("w0", "device", H[:3], ())
    index.publish("w1", "host", H[:2], ())
    index.publish("w2", "disk", H[1:], ())
    assert index.longest_prefixes(H) == {"w0": (3, "device"), "w1": (2, "host")}
    assert index.longest_prefixes(H[1:]) == {
        "w0": (2, "device"),
        "w1": (1, "host"),
        "w2": (3, "disk"),
    }
    assert index.longest_prefixes([]) == {}
    assert index.longest_prefixes([12345]) == {}


def test_eviction_shortens_the_prefix_and_wins_over_a_store_in_the_same_batch(
    make: IndexFactory,
) -> None:
    index = make()
    index.publish("w0", "device", H, ())
    index.publish("w0", "device", (), [H[2]])
    assert index.longest_prefixes(H) == {"w0": (2, "device")}
    index.publish("w1", "host", H[:1], H[:1])
    assert index.longest_prefixes(H) == {"w0": (2, "device")}


def test_prefix_tier_is_the_slowest_of_each_blocks_fastest_copy(make: IndexFactory) -> None:
    index = make()
    index.publish("n0", "device", H[:1], ())
    index.publish("n0", "disk", H[:3], ())
    assert index.longest_prefixes(H) == {"n0": (3, "disk")}
    index.publish("n0", "host", H[1:3], ())
    assert index.longest_prefixes(H) == {"n0": (3, "host")}
    index.publish("n0", "device", H[1:3], ())
    assert index.longest_prefixes(H) == {"n0": (3, "device")}


def test_drop_holder_and_rebuild_replace_a_holders_entries(make: IndexFactory) -> None:
    index = make()
    index.publish("w0", "device", H, ())
    index.publish("w0", "host", H, ())
    index.publish("w1", "device", H[:1], ())
    index.rebuild("w0", "device", H[:2])
    assert index.longest_prefixes(H) == {"w0": (4, "host"), "w1": (1, "device")}
    index.drop_holder("w0")
    assert index.longest_prefixes(H) == {"w1": (1, "device")}


def test_entries_expire_ttl_after_their_last_publish(make: IndexFactory) -> None:
    clock = FakeClock()
    index = make(clock)
    index.publish("w0", "device", H, ())
    clock.now += TTL_S / 2
    index.publish("w0", "device", H[:1], ())
    index.publish("w1", "host", H[:2], ())
    clock.now += TTL_S / 2 + 1
    assert index.longest_prefixes(H) == {"w0": (1, "device"), "w1": (2, "host")}
    clock.now += TTL_S
    assert index.longest_prefixes(H) == {}


def test_unknown_tier_is_rejected(make: IndexFactory) -> None:
    with pytest.raises(ValueError, match="unknown tier"):
        make().publish("w0", "gpu", H, ())


def test_redis_keys_carry_a_ttl(redis_server: RedisProcess) -> None:
    index = RedisPrefixIndex(redis_server.url, 60.0, namespace="ttl")
    index.publish("w0", "device", H[:1], ())
    client = redis.Redis.from_url(redis_server.url)
    assert 0 < client.ttl(f"ttl:b:{H[0]:016x}") <= 60
    assert client.hkeys(f"ttl:b:{H[0]:016x}") == [b"w0@device"]


def test_make_index_reads_the_url_scheme(redis_server: RedisProcess) -> None:
    assert isinstance(make_index("memory://"), MemoryPrefixIndex)
    assert isinstance(make_index(redis_server.url), RedisPrefixIndex)
    tls = make_index("rediss://:secret@127.0.0.1:1/2")
    assert isinstance(tls, RedisPrefixIndex)
    kwargs = tls._client.connection_pool.connection_kwargs
    assert tls._client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert (kwargs["password"], kwargs["db"]) == ("secret", 2)
    with pytest.raises(ValueError, match=r"prefix_index\.url"):
        make_index("etcd://x")


def test_password_in_the_url_authenticates(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path, password="s3cret")
    server.start()
    try:
        index = RedisPrefixIndex(server.url, TTL_S)
        index.publish("w0", "device", H, ())
        assert index.longest_prefixes(H) == {"w0": (4, "device")}
        wrong = RedisPrefixIndex(server.url.replace("s3cret", "wrong"), TTL_S)
        assert wrong.longest_prefixes(H) == {}
        assert not wrong.healthy()
    finally:
        server.stop()


def test_redis_outage_degrades_to_empty_answers_and_a_restart_is_rebuilt(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path)
    server.start()
    try:
        index = RedisPrefixIndex(server.url, TTL_S, retry_interval_s=0.0)
        holdings = {"device": list(H)}
        buffer = PublishBuffer(index, "w0", 1.0, lambda: holdings)
        buffer.stored("device", H)
        buffer.flush()
        assert index.longest_prefixes(H) == {"w0": (4, "device")}
        server.stop()
        assert index.longest_prefixes(H) == {}
        assert not index.healthy()
        buffer.evicted("device", H[3:])
        holdings["device"] = list(H[:3])
        buffer.flush()
        server.start()
        assert index.healthy()
        assert index.longest_prefixes(H) == {}
        buffer.flush()
        assert index.longest_prefixes(H) == {"w0": (3, "device")}
    finally:
        server.stop()


def test_a_reset_seen_only_by_the_probe_triggers_a_rebuild(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path)
    server.start()
    try:
        index = RedisPrefixIndex(server.url, TTL_S, retry_interval_s=0.0)
        buffer = PublishBuffer(index, "w0", 1.0, lambda: {"device": H[:2]})
        assert index.healthy()
        index.publish("w0", "device", H[:2], ())
        redis.Redis.from_url(server.url).flushall()
        assert index.healthy()
        buffer.flush()
        assert index.longest_prefixes(H) == {"w0": (2, "device")}
    finally:
        server.stop()


def test_publish_buffer_batches_until_the_interval_and_keeps_the_latest_event() -> None:
    clock = FakeClock()
    index = MemoryPrefixIndex()
    buffer = PublishBuffer(index, "w0", 0.5, lambda: {}, clock=clock)
    buffer.stored("device", H)
    buffer.evicted("device", H[2:3])
    buffer.stored("device", H[3:])
    assert not buffer.maybe_flush()
    assert index.longest_prefixes(H) == {}
    clock.now += 0.5
    assert buffer.maybe_flush()
    assert index.longest_prefixes(H) == {"w0": (2, "device")}
    buffer.stored("device", H[2:3])
    buffer.stop()
    assert index.longest_prefixes(H) == {"w0": (4, "device")}


def test_an_unresponsive_redis_costs_each_caller_at_most_its_timeout_once_per_retry() -> None:
    """A Redis that accepts connections and never answers (hung, or partitioned behind a
    proxy) must not stall routing or publishing: the first call waits out the socket timeout
    and answers empty, the calls within the retry interval after it answer at once, and the
    next probe waits at most one timeout again."""
    with hung_listener() as (port, accepted):
        _check_unresponsive(f"redis://127.0.0.1:{port}/0", accepted)


def _check_unresponsive(url: str, accepted: list[socket.socket]) -> None:
    index = RedisPrefixIndex(url, TTL_S, timeout_s=0.2, retry_interval_s=0.5)
    try:
        start = time.monotonic()
        assert index.longest_prefixes(H) == {}
        first = time.monotonic() - start
        assert first < 0.6  # one socket timeout, not a hang
        start = time.monotonic()
        for _ in range(50):
            assert index.longest_prefixes(H) == {}
            index.publish("w0", "device", list(H), ())
        assert time.monotonic() - start < 0.1  # inside the retry interval: no round trip
        time.sleep(0.5)
        start = time.monotonic()
        assert not index.healthy()
        assert index.longest_prefixes(H) == {}
        assert time.monotonic() - start < 1.0  # the probe and one lookup: a timeout each
        assert accepted, "the client did reach the listener"
    finally:
        index.close()


def test_malformed_redis_entries_are_skipped_and_counted(redis_server: RedisProcess) -> None:
    """Issue 48: one value that is not a time made every lookup through its block raise."""
    namespace = f"test:{uuid.uuid4().hex}"
    index = RedisPrefixIndex(redis_server.url, TTL_S, namespace=namespace, clock=FakeClock())
    index.publish("w1", "device", H, ())
    client = redis.Redis.from_url(redis_server.url)
    key = [f"{namespace}:b:{block_hash:016x}" for block_hash in H]
    client.hset(key[1], "x@device", "notafloat")
    client.hset(key[1], b"\xff@device", "1000.0")
    client.hset(key[2], "y@device", "nan")
    client.delete(key[3])
    client.set(key[3], "not a hash")
    epoch = index.epoch
    assert index.longest_prefixes(H) == {"w1": (3, "device")}
    assert index.malformed_entries == 4
    assert index.longest_prefixes(H[:2]) == {"w1": (2, "device")}
    assert index.malformed_entries == 6  # block 1 read again
    assert index.healthy() and index.epoch == epoch
    index.close()
