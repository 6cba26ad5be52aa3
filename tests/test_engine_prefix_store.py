"""The engine with a block store: write-through, prefix loads from host and disk, misses."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.loader import resolve_model
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.store_writer import PinnedSlabs
from splitserve.kvstore.store import BlockStore, BlockStoreConfig

pytestmark = pytest.mark.slow
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPT = "You are a careful assistant who answers in one sentence. " * 8 + "What is tea?"


class Events:
    def __init__(self) -> None:
        self.log: list[tuple[str, str, int]] = []

    def stored(self, tier: str, block_hashes: Any) -> None:
        self.log += [("stored", tier, h) for h in block_hashes]

    def evicted(self, tier: str, block_hashes: Any) -> None:
        self.log += [("evicted", tier, h) for h in block_hashes]


def _llm(tokenizer: Any, store: BlockStore | None, events: Events | None = None) -> LLM:
    config = EngineConfig(max_model_len=2048, kv_cache_bytes=64 << 20)
    return LLM.from_engine(LLMEngine(config, tokenizer, store, events))


def _run(llm: LLM, prompt: str = PROMPT) -> list[int]:
    return list(llm.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids)


def test_second_engine_loads_prefix_from_host_tier_with_identical_output(
    smollm2_tokenizer: Any, smollm2_llm: LLM
) -> None:
    store = BlockStore(BlockStoreConfig(host_bytes=256 << 20))
    events = Events()
    first = _llm(smollm2_tokenizer, store, events)
    expected = _run(smollm2_llm)
    assert _run(first) == expected
    num_prompt = len(smollm2_tokenizer.encode(PROMPT))
    assert len(store.host) == (num_prompt + GREEDY.max_tokens - 1) // 16  # KV-complete blocks
    assert [e for e in events.log if e[1] == "device"][:1][0][0] == "stored"

    second = _llm(smollm2_tokenizer, store)
    assert _run(second) == expected
    stats = second.engine.stats()
    usable = (num_prompt - 1) // 16 * 16
    assert stats.cached_tokens_by_tier == {"host": usable}
    assert stats.prompt_tokens_computed == num_prompt - usable
    assert stats.prompt_tokens_queried == num_prompt


def test_an_engine_of_another_model_identity_never_reads_the_shared_disk_tiers_blocks(
    smollm2_tokenizer: Any, smollm2_llm: LLM, tmp_path: Path
) -> None:
    """The same weights named by their path instead of their alias are another model to the
    block hashes (hashing.hash_root): a shared directory gives it nothing; the alias hits."""
    config = BlockStoreConfig(host_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 30)
    expected = _run(smollm2_llm)
    assert _run(_llm(smollm2_tokenizer, BlockStore(config))) == expected
    by_path = EngineConfig(
        model=str(resolve_model("smollm2-135m-instruct")),
        max_model_len=2048,
        kv_cache_bytes=64 << 20,
    )
    other = LLM.from_engine(LLMEngine(by_path, smollm2_tokenizer, BlockStore(config)))
    assert _run(other) == expected
    num_prompt = len(smollm2_tokenizer.encode(PROMPT))
    assert other.engine.stats().prompt_tokens_computed == num_prompt
    same = _llm(smollm2_tokenizer, BlockStore(config))
    assert _run(same) == expected
    assert same.engine.stats().cached_tokens_by_tier == {"disk": (num_prompt - 1) // 16 * 16}


def test_corrupt_disk_block_is_a_miss_and_recomputed(
    smollm2_tokenizer: Any, smollm2_llm: LLM, tmp_path: Path
) -> None:
    config = BlockStoreConfig(host_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 30)
    expected = _run(smollm2_llm)
    assert _run(_llm(smollm2_tokenizer, BlockStore(config))) == expected
    files = list(tmp_path.glob("*/*.kv"))
    num_prompt = len(smollm2_tokenizer.encode(PROMPT))
    assert len(files) == (num_prompt + GREEDY.max_tokens - 1) // 16
    store = BlockStore(config)
    third_block = store.disk.keys()[2] if store.disk is not None else 0
    path = tmp_path / f"{third_block:016x}"[:2] / f"{third_block:016x}.kv"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    llm = _llm(smollm2_tokenizer, store)
    assert _run(llm) == expected
    stats = llm.engine.stats()
    assert stats.cached_tokens_by_tier == {"disk": 2 * 16}
    assert stats.prompt_tokens_computed == num_prompt - 2 * 16


def test_store_without_disk_gets_only_the_blocks_its_host_tier_keeps(
    smollm2_tokenizer: Any, smollm2_llm: LLM, tmp_path: Path
) -> None:
    """A burst of new blocks is copied out only as far as the host tier can keep it: the
    store ends as an unbounded write-through would leave an LRU of that size."""
    block_bytes = smollm2_llm.engine.runner.kv_bytes_per_block()
    room = BlockStore(BlockStoreConfig(host_bytes=1 << 30))
    _run(_llm(smollm2_tokenizer, room))
    small = BlockStore(BlockStoreConfig(host_bytes=3 * block_bytes))
    assert small.max_blocks(block_bytes) == 3
    _run(_llm(smollm2_tokenizer, small))
    assert small.host.keys() == room.host.keys()[-3:]
    with_disk = BlockStoreConfig(host_bytes=0, disk_path=str(tmp_path), disk_bytes=1 << 30)
    assert BlockStore(with_disk).max_blocks(block_bytes) is None


def test_a_flush_finding_no_free_staging_slab_writes_nothing_through(
    smollm2_tokenizer: Any,
) -> None:
    """On CUDA the write-through lands in a few staging slabs allocated once: a flush while
    every slab is still being put into the store skips its blocks (they stay on the device)
    instead of pinning more memory or waiting; once a slab is back, flushes write again, at
    most a slab's worth each. (A CPU copies synchronously; here unpinned slabs stand in.)"""
    store = BlockStore(BlockStoreConfig(host_bytes=256 << 20))
    llm = _llm(smollm2_tokenizer, store)
    cache, runner = llm.engine.prefix_cache, llm.engine.runner
    assert cache is not None and cache.slabs is None  # CPU
    cache.slabs = slabs = PinnedSlabs(1, runner.kv_block_shape(2), runner.dtype, pin=False)
    held = slabs.acquire()
    assert held is not None and slabs.acquire() is None
    _run(llm)
    assert len(store.host) == 0 and cache.skipped_blocks >= 6  # a ~100-token prompt
    slabs.releaser(held)()
    _run(llm, "A different prompt about coffee and nothing else at all. " * 8)
    flushes_with_new_blocks = 2  # the prompt's prefill step, one decode step crossing a block
    assert 2 <= len(store.host) <= 2 * flushes_with_new_blocks
    assert slabs.acquire() is not None  # handed back after the synchronous put
