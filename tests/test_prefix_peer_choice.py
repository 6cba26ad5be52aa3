"""Which peer a prefill worker pulls a prompt's prefix from (router/prefix_lookup: best_peer,
holds), and the staged blocks the engine loads them from (services/peer_blocks.StagedBlocks)."""

from __future__ import annotations

import torch

from splitserve.kvstore.store import BlockStore, BlockStoreConfig
from splitserve.router.policy import Candidate
from splitserve.router.prefix_lookup import best_peer, holds
from splitserve.services.workers.peer_blocks import StagedBlocks


def test_the_peer_with_the_longest_prefix_beyond_what_the_chosen_worker_has_is_named() -> None:
    cached = {"prefill-0": 2, "prefill-1": 5, "prefill-2": 7, "node:h:/kv": 9}
    assert best_peer(cached, 2, ["prefill-1", "prefill-2"], 10) == ("prefill-2", 7)
    assert best_peer(cached, 2, ["prefill-1", "prefill-2"], 6) == ("prefill-2", 6)
    assert best_peer(cached, 2, ["prefill-1", "prefill-2"], 5) == ("prefill-1", 5)


def test_no_peer_when_none_has_more_than_the_chosen_worker() -> None:
    cached = {"prefill-0": 5, "prefill-1": 5}
    assert best_peer(cached, 5, ["prefill-1"], 10) is None
    assert best_peer(cached, 0, [], 10) is None
    assert best_peer({"prefill-1": 3}, 0, ["prefill-1"], 0) is None


def _block(value: float) -> torch.Tensor:
    return torch.full((2, 1, 4, 1, 2), value)


def test_staged_blocks_continue_the_store_prefix_and_go_with_their_request() -> None:
    store = BlockStore(BlockStoreConfig(host_bytes=1 << 20))
    store.put(1, _block(1.0))
    staged = StagedBlocks(store)
    staged.stage("r", [2, 3], torch.stack([_block(2.0), _block(3.0)], dim=2))
    found = staged.load_prefix([1, 2, 3, 4])
    assert [tier for _, tier in found] == ["host", "remote", "remote"]
    assert [float(t[0, 0, 0, 0, 0]) for t, _ in found] == [1.0, 2.0, 3.0]
    assert [tier for _, tier in staged.load_prefix([2, 9, 3])] == ["remote"]
    staged.stage("s", [3], _block(3.0).unsqueeze(2))
    staged.release("r")
    assert len(staged) == 1
    assert staged.load_prefix([2]) == []
    staged.release("s")
    assert len(staged) == 0


def test_a_worker_serves_its_own_blocks_and_its_nodes_disk_tier() -> None:
    """A prefix only on another node's disk is pulled through a live worker of that node."""
    cached = {"prefill-0": 1, "node:b:/kv": 6, "prefill-2": 4}
    assert holds(cached, Candidate("prefill-0", node_id="node:a:/kv")) == 1
    assert holds(cached, Candidate("prefill-1", node_id="node:b:/kv")) == 6
    assert holds(cached, Candidate("prefill-2")) == 4
