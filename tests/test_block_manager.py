"""Block manager and scheduler on tiny specs: exact block ids, reuse and eviction order."""

from __future__ import annotations

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.scheduler import Scheduler
from splitserve.kvstore.hashing import block_hashes, hash_block, hash_root


def _req(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, SamplingParams(max_tokens=4))


def test_block_hashes_chain_over_full_blocks_only() -> None:
    hashes = block_hashes(list(range(10)), 4, 0)
    assert len(hashes) == 2
    assert hashes[1] == hash_block(hash_block(0, [0, 1, 2, 3]), [4, 5, 6, 7])
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4, 0)[1] != hashes[1]
    assert all(0 <= h < 2**64 for h in hashes)


def test_the_hash_root_separates_models_dtypes_and_block_sizes() -> None:
    roots = [
        hash_root("smollm2-135m-instruct", "float32", 16),
        hash_root("/models/other-135m.gguf", "float32", 16),
        hash_root("smollm2-135m-instruct", "bfloat16", 16),
        hash_root("smollm2-135m-instruct", "float32", 32),
    ]
    assert len(set(roots)) == 4
    assert roots[0] == hash_root("smollm2-135m-instruct", "float32", 16)
    chains = [block_hashes(list(range(32)), 16, root) for root in roots]
    assert len({h for chain in chains for h in chain}) == 8
    assert chains[0][1] == hash_block(hash_block(roots[0], list(range(16))), list(range(16, 32)))


def test_block_managers_of_two_roots_never_share_a_prefix() -> None:
    tokens = list(range(9))
    ours, theirs = (BlockManager(8, 4, True, root) for root in (1, 2))
    for bm in (ours, theirs):
        req = _req("a", tokens)
        assert bm.allocate_slots(req, len(tokens))
        req.num_computed_tokens = len(tokens)
        bm.commit(req)
    assert set(ours.cached).isdisjoint(theirs.cached)
    assert sorted(ours.cached) == sorted(block_hashes(tokens, 4, 1))


def test_allocation_takes_lowest_free_blocks_in_order() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, root=0)
    a = _req("a", list(range(10)))
    assert bm.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    b = _req("b", list(range(100, 105)))
    assert bm.allocate_slots(b, 5)
    assert b.block_table == [3, 4]
    assert bm.num_free_blocks == 3
    assert not bm.allocate_slots(_req("c", list(range(20))), 20)


def test_finished_prefix_is_reused_and_shared_blocks_are_ref_counted() -> None:
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, root=0)
    a = _req("a", list(range(10)))
    bm.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    bm.commit(a)
    b = _req("b", [*range(8), 50, 51, 52])
    assert bm.allocate_prefix(b) == 8
    assert b.block_table == [0, 1]
    assert bm.blocks[0].ref_count == 2
    bm.free(a)
    assert bm.blocks[0].ref_count == 1 and bm.blocks[2].ref_count == 0
    # The whole prompt is cached, yet the last token is left to compute.
    c = _req("c", list(range(8)))
    assert bm.allocate_prefix(c) == 4


def test_lru_eviction_reclaims_oldest_freed_and_suffixes_before_prefixes() -> None:
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True, root=0)
    a = _req("a", [1, 2, 3, 4])
    bm.allocate_slots(a, 4)
    a.num_computed_tokens = 4
    bm.commit(a)
    b = _req("b", [7, 8])
    bm.allocate_slots(b, 2)
    b.num_computed_tokens = 2
    bm.commit(b)
    bm.free(a)
    bm.free(b)
    assert list(bm.free_queue) == [3, 1, 0, 2]
    d = _req("d", [9, 9, 9, 9])
    bm.allocate_slots(d, 4)
    assert d.block_table == [3, 1]
    again = _req("a2", [1, 2, 3, 4, 5])
    assert bm.allocate_prefix(again) == 2
    assert again.block_table == [0]


def test_scheduler_respects_token_budget_and_chunks_long_prompts() -> None:
    config = EngineConfig(block_size=4, max_num_batched_tokens=8, max_num_seqs=4)
    bm = BlockManager(num_blocks=32, block_size=4, enable_prefix_caching=False, root=0)
    scheduler = Scheduler(config, bm)
    long, short = _req("long", list(range(20))), _req("short", [1, 2, 3])
    scheduler.add(long)
    scheduler.add(short)
    first = scheduler.schedule()
    assert [r.request_id for r in first.requests] == ["long"]
    assert first.num_new_tokens == [8]
    long.num_computed_tokens += 8
    second = scheduler.schedule()
    assert second.num_new_tokens == [8]
    long.num_computed_tokens += 8
    third = scheduler.schedule()
    assert [r.request_id for r in third.requests] == ["long", "short"]
    assert third.num_new_tokens == [4, 3]


def test_scheduler_preempts_newest_request_when_blocks_run_out() -> None:
    config = EngineConfig(block_size=2, max_num_batched_tokens=64, max_num_seqs=4)
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False, root=0)
    scheduler = Scheduler(config, bm)
    old, new = _req("old", [1, 2, 3, 4]), _req("new", [5, 6, 7, 8])
    scheduler.add(old)
    scheduler.add(new)
    scheduler.schedule()
    for req in (old, new):
        req.num_computed_tokens = 4
        req.output_token_ids.append(9)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["old"]
    assert batch.num_preempted == 1
    assert list(scheduler.waiting) == [new] and new.num_computed_tokens == 0
    assert old.block_table == [0, 1, 3]


def test_waiting_requests_holding_blocks_cannot_starve_the_queue_head() -> None:
    config = EngineConfig(block_size=2, max_num_batched_tokens=64, max_num_seqs=4)
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=False, root=0)
    scheduler = Scheduler(config, bm)
    first, second = _req("first", [1, 2, 3, 4]), _req("second", [5, 6, 7, 8])
    for req in (first, second):
        # As after a KV handoff: the prompt's blocks are filled and one token was sampled.
        assert bm.allocate_slots(req, 4)
        req.num_computed_tokens = 4
        req.output_token_ids.append(9)
        scheduler.add(req)
    batch = scheduler.schedule()
    assert [r.request_id for r in batch.requests] == ["first"]
    assert second.block_table == [] and second.num_computed_tokens == 0
    assert first.block_table == [0, 1, 3]


def test_queued_prompt_tokens_leave_out_the_prefix_a_waiting_request_will_find() -> None:
    """The load a prefill worker reports to the router: a waiting request whose first two
    blocks are cached counts only the rest of its prompt (and claims nothing by being counted)."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True, root=0)
    scheduler = Scheduler(EngineConfig(block_size=4), bm)
    done = _req("done", list(range(10)))
    bm.allocate_slots(done, 10)
    done.num_computed_tokens = 10
    bm.commit(done)
    bm.free(done)
    scheduler.add(_req("hit", [*range(8), 60, 61, 62]))
    scheduler.add(_req("miss", [70, 71, 72, 73, 74]))
    assert scheduler.queued_prompt_tokens() == (11 - 8) + 5
    assert bm.num_free_blocks == 8


def test_entries_of_two_blocks_are_published_and_reused_two_blocks_at_a_time() -> None:
    """Entries of 8 tokens in blocks of 4 (DeepSeek-V4's HCA spreads an entry over its
    tokens' slots): a block is published once its pair's entry closed, and a hit of 3 blocks
    (the fourth evicted) keeps 2, handing the third back still cached."""
    bm = BlockManager(8, 4, True, 0, entry_tokens=8)
    a = _req("a", list(range(17)))
    assert bm.allocate_slots(a, 17)
    a.num_computed_tokens = 14
    bm.commit(a)
    assert [bm.blocks[i].block_hash is not None for i in a.block_table] == [1, 1, 0, 0, 0]
    a.num_computed_tokens = 16
    bm.commit(a)
    assert len(bm.cached) == 4
    bm.free(a)  # free queue: 5, 6, 7, 4, 3, 2, 1, 0
    assert bm.allocate_slots(_req("x", list(range(50, 70))), 20)  # evicts blocks 4 and 3
    b = _req("b", [*range(16), 99])
    assert bm.cached_prefix_tokens(b) == 8
    assert bm.allocate_prefix(b) == 8 and b.block_table == [0, 1]
    assert bm.blocks[2].ref_count == 0 and 2 in bm.free_queue and len(bm.cached) == 3
