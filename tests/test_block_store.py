"""BlockStore: host LRU, demotion to disk, disk budget, checksums, retention, atomic writes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch

from splitserve.kvstore import block_codec
from splitserve.kvstore.disk_tier import DiskTier
from splitserve.kvstore.store import DAY_S, BlockStore, BlockStoreConfig, RetentionPolicy

SHAPE = (2, 2, 4, 1, 2)  # [2, layers, block_size, kv_heads, head_dim]
BLOCK_BYTES = 128
FILE_BYTES = 48 + 8 * len(SHAPE) + BLOCK_BYTES


def kv(seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.arange(32, dtype=torch.float32).reshape(SHAPE).add(100 * seed).to(dtype)


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, list[int]]] = []

    def stored(self, tier: str, block_hashes: Sequence[int]) -> None:
        self.events.append(("stored", tier, list(block_hashes)))

    def evicted(self, tier: str, block_hashes: Sequence[int]) -> None:
        self.events.append(("evicted", tier, list(block_hashes)))


class Clock:
    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def store(
    tmp_path: Path | None, host_blocks: int, disk_blocks: int = 0, clock: Clock | None = None
) -> tuple[BlockStore, Recorder]:
    config = BlockStoreConfig(
        host_bytes=host_blocks * BLOCK_BYTES,
        disk_path=str(tmp_path / "kv") if tmp_path else None,
        disk_bytes=disk_blocks * FILE_BYTES,
    )
    recorder = Recorder()
    return BlockStore(config, recorder, clock=clock or Clock()), recorder


def disk(blocks: BlockStore) -> DiskTier:
    assert blocks.disk is not None
    return blocks.disk


def test_host_tier_evicts_least_recently_used_first() -> None:
    blocks, recorder = store(None, host_blocks=3)
    for h in (1, 2, 3):
        blocks.put(h, kv(h))
    assert blocks.get(1) is not None
    blocks.put(4, kv(4))
    assert blocks.host.keys() == [3, 1, 4]
    assert blocks.get(2) is None
    assert recorder.events[-2:] == [("stored", "host", [4]), ("evicted", "host", [2])]


def test_host_evictions_move_to_disk_and_a_disk_hit_comes_back_up(tmp_path: Path) -> None:
    blocks, recorder = store(tmp_path, host_blocks=2, disk_blocks=10)
    for h in (1, 2, 3):
        blocks.put(h, kv(h))
    assert (blocks.host.keys(), disk(blocks).keys()) == ([2, 3], [1])
    tensor, tier = blocks.get(1)  # type: ignore[misc]
    assert tier == "disk" and torch.equal(tensor, kv(1))
    assert (blocks.host.keys(), disk(blocks).keys()) == ([3, 1], [1, 2])
    assert recorder.events[3:] == [
        ("evicted", "host", [1]),
        ("stored", "disk", [1]),
        ("stored", "host", [1]),
        ("evicted", "host", [2]),
        ("stored", "disk", [2]),
    ]
    assert blocks.snapshot() == {"host": [3, 1], "disk": [1, 2]}


def test_disk_budget_deletes_its_least_recently_used_files(tmp_path: Path) -> None:
    blocks, recorder = store(tmp_path, host_blocks=1, disk_blocks=2)
    for h in (1, 2, 3, 4):
        blocks.put(h, kv(h))
    assert disk(blocks).keys() == [2, 3]
    assert disk(blocks).used_bytes == 2 * FILE_BYTES
    assert not disk(blocks).path_of(1).exists()
    assert ("evicted", "disk", [1]) in recorder.events
    assert blocks.get(1) is None


@pytest.mark.parametrize("offset", [5, 30, FILE_BYTES - 1])
def test_a_flipped_byte_is_a_miss_and_the_file_is_removed(tmp_path: Path, offset: int) -> None:
    blocks, recorder = store(tmp_path, host_blocks=0, disk_blocks=4)
    blocks.put(7, kv(7))
    path = disk(blocks).path_of(7)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
    assert blocks.get(7) is None
    assert not path.exists() and 7 not in disk(blocks)
    assert recorder.events[-1] == ("evicted", "disk", [7])


def test_a_truncated_file_is_a_miss(tmp_path: Path) -> None:
    blocks, _ = store(tmp_path, host_blocks=0, disk_blocks=4)
    blocks.put(7, kv(7))
    path = disk(blocks).path_of(7)
    path.write_bytes(path.read_bytes()[:-10])
    assert blocks.get(7) is None
    assert not path.exists()


def test_retention_follows_the_traffic_class(tmp_path: Path) -> None:
    clock = Clock()
    blocks, recorder = store(tmp_path, host_blocks=1, disk_blocks=4, clock=clock)
    blocks.put(1, kv(1), "agent")
    blocks.put(2, kv(2), "chat")
    blocks.put(3, kv(3))
    clock.now += 3 * DAY_S + 1
    assert blocks.get(1) is None
    assert blocks.get(2) is not None
    assert blocks.expire() == 0
    clock.now += 4 * DAY_S
    assert blocks.expire() == 3  # the hit copied 2 up to host; 3 went down to disk
    assert blocks.snapshot() == {"host": [], "disk": []}
    assert recorder.events[-2:] == [("evicted", "host", [2]), ("evicted", "disk", [2, 3])]


def test_a_hit_with_a_class_extends_retention() -> None:
    clock = Clock()
    blocks, _ = store(None, host_blocks=2, clock=clock)
    blocks.put(1, kv(1), "agent")
    clock.now += 2 * DAY_S
    assert blocks.get(1, "chat") is not None
    clock.now += 6 * DAY_S
    assert blocks.get(1) is not None


def test_retention_policy_is_configurable_and_rejects_unknown_classes() -> None:
    policy = RetentionPolicy({"batch": 60.0, "chat": 120.0}, default_class="batch")
    assert (policy.ttl(None), policy.ttl("chat")) == (60.0, 120.0)
    with pytest.raises(ValueError, match="unknown traffic class"):
        policy.ttl("agent")
    with pytest.raises(ValueError, match="default class"):
        RetentionPolicy({"chat": 1.0}, default_class="agent")


def test_writes_are_atomic_and_leave_no_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocks, _ = store(tmp_path, host_blocks=0, disk_blocks=8)
    for h in range(5):
        blocks.put(h, kv(h))

    def fail(src: str, dst: str) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        blocks.put(99, kv(99))
    files = sorted(p.name for p in (tmp_path / "kv").rglob("*") if p.is_file())
    assert files == sorted(f"{h:016x}.kv" for h in range(5))


def test_a_restarted_store_adopts_its_files_in_access_order(tmp_path: Path) -> None:
    blocks, _ = store(tmp_path, host_blocks=0, disk_blocks=8)
    for h in (1, 2, 3):
        blocks.put(h, kv(h))
    for age, h in enumerate((2, 3, 1)):
        os.utime(disk(blocks).path_of(h), (1000 + age, 1000 + age))
    block_file = disk(blocks).path_of(4)
    leftover = block_file.with_name(f".{block_file.name}.{'0' * 32}.tmp")
    leftover.write_bytes(b"partial")
    again, _ = store(tmp_path, host_blocks=0, disk_blocks=8)
    assert again.snapshot() == {"host": [], "disk": [2, 3, 1]}
    assert not leftover.exists()
    assert torch.equal(again.get(3)[0], kv(3))  # type: ignore[index]


def test_the_disk_tier_leaves_files_it_did_not_write(tmp_path: Path) -> None:
    """Files of other names under the directory survive a restart's clean-up and evictions."""
    root = tmp_path / "kv"
    foreign = [
        root / "notes.txt",
        root / "00" / "readme.md",
        root / "00" / "1234.kv",
        root / "00" / ".x.tmp",
        root / "models" / "0000000000000001.kv",
        root / "0A" / "0000000000000001.kv",
    ]
    for path in foreign:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"not ours")
    blocks, _ = store(tmp_path, host_blocks=0, disk_blocks=2)
    for h in (1, 2, 3, 4):
        blocks.put(h, kv(h))
    again, _ = store(tmp_path, host_blocks=0, disk_blocks=1)
    assert again.snapshot() == {"host": [], "disk": [4]}
    assert [p.read_bytes() for p in foreign] == [b"not ours"] * len(foreign)


def test_load_prefix_stops_at_the_first_missing_block() -> None:
    blocks, _ = store(None, host_blocks=4)
    for h in (1, 2, 4):
        blocks.put(h, kv(h))
    loaded = blocks.load_prefix([1, 2, 3, 4])
    assert [tier for _, tier in loaded] == ["host", "host"]
    assert torch.equal(loaded[1][0], kv(2))


def test_the_store_keeps_its_own_copy() -> None:
    blocks, _ = store(None, host_blocks=1)
    source = kv(1)
    blocks.put(1, source)
    source.zero_()
    assert torch.equal(blocks.get(1)[0], kv(1))  # type: ignore[index]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_codec_round_trips_exact_bytes_and_checks_the_hash(dtype: torch.dtype) -> None:
    tensor = kv(3, dtype)
    data = block_codec.encode(42, 5.0, tensor)
    decoded, expiry = block_codec.decode(data, 42)
    assert expiry == 5.0 and decoded.dtype == dtype
    assert torch.equal(decoded.view(torch.uint8), tensor.view(torch.uint8))
    with pytest.raises(block_codec.CorruptBlock, match="holds block"):
        block_codec.decode(data, 43)
