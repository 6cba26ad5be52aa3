"""Speculative decoding's parts on their own: the n-gram lookup, the block rollback, the
config and the counters (the planner: tests/test_spec_dynamic.py)."""

from __future__ import annotations

import random

import pytest

from splitserve.config import ConfigError, load_config
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.spec.ngram import lookup
from splitserve.services.messages import WorkerStats
from splitserve.services.metrics import Metrics


def test_ngram_lookup_follows_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert lookup(tokens, 1, 3, 4) == [4, 5, 7, 2]  # "2 3" last seen before 4 5 7 2
    assert lookup(tokens, 1, 3, 2) == [4, 5]
    assert lookup([5, 6, 7, 5, 6], 2, 2, 8) == [7, 5, 6]  # the draft may run to the end
    assert lookup([1, 2, 3, 4], 1, 3, 4) == []
    assert lookup([8, 1, 2, 8], 2, 3, 4) == []  # a one-token match is below prompt_lookup_min
    assert lookup([8, 1, 2, 8], 1, 3, 4) == [1, 2, 8]


def _lookup_by_definition(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        ends = [e for e in range(n, len(tokens)) if tokens[e - n : e] == tokens[-n:]]
        if ends:
            return tokens[ends[-1] : ends[-1] + k]
    return []


def test_ngram_lookup_equals_its_definition_on_repetitive_sequences() -> None:
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.randint(1, 4)) for _ in range(rng.randint(1, 30))]
        min_n = rng.randint(1, 3)
        max_n, k = rng.randint(min_n, 5), rng.randint(1, 6)
        assert lookup(tokens, min_n, max_n, k) == _lookup_by_definition(tokens, min_n, max_n, k)


def test_trim_returns_the_tail_blocks_of_rejected_drafts() -> None:
    manager = BlockManager(8, 4, True, 0)
    req = Request("a", list(range(10)), SamplingParams())
    assert manager.allocate_slots(req, 10 + 6)  # ten tokens and six drafts: four blocks
    assert req.block_table == [0, 1, 2, 3]
    manager.trim(req, 11)
    assert req.block_table == [0, 1, 2]
    assert list(manager.free_queue) == [4, 5, 6, 7, 3]
    manager.trim(req, 12)
    assert req.block_table == [0, 1, 2]


def test_speculative_config_reads_vllm_keys_and_names_an_unknown_one() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.dynamic) == (3, 2, True)
    with pytest.raises(ValueError, match="unknown speculative_config key 'lookahead'"):
        SpeculativeConfig.from_dict({"lookahead": 3})
    with pytest.raises(ValueError, match="needs `model`"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)


def test_a_pool_speculative_section_reaches_its_engine_config() -> None:
    config = load_config(
        None,
        ["pools.decode.speculative.method=ngram", "pools.decode.speculative.prompt_lookup_max=4"],
    )
    assert config.pools["decode"].engine.speculative == SpeculativeConfig(prompt_lookup_max=4)
    assert config.pools["prefill"].engine.speculative is None
    with pytest.raises(ConfigError, match="not 'prefill' ones"):
        load_config(None, ["pools.prefill.speculative.method=ngram"])
    with pytest.raises(ConfigError, match=r"engine\.speculative cannot be set"):
        load_config(None, ["pools.decode.engine.speculative.method=ngram"])


def test_spec_decode_counters_grow_by_the_change_between_stats() -> None:
    metrics = Metrics("m")
    before = WorkerStats(worker_id="w", spec_num_drafts=2, spec_accepted_per_pos=[1])
    after = WorkerStats(
        worker_id="w", spec_num_drafts=5, spec_num_draft_tokens=12,
        spec_num_accepted_tokens=7, spec_accepted_per_pos=[4, 3],
    )  # fmt: skip
    metrics.observe_stats("decode", before, None)
    metrics.observe_stats("decode", after, before)
    text = metrics.render().decode()
    labels = 'model_name="m",pool="decode",worker="w"'
    assert f"splitserve:spec_decode_num_drafts_total{{{labels}}} 5.0" in text
    assert f"splitserve:spec_decode_num_draft_tokens_total{{{labels}}} 12.0" in text
    assert f"splitserve:spec_decode_num_accepted_tokens_total{{{labels}}} 7.0" in text
    per_pos = "splitserve:spec_decode_num_accepted_tokens_per_pos_total"
    at = 'model_name="m",pool="decode",position="{}",worker="w"'
    assert f"{per_pos}{{{at.format(0)}}} 4.0" in text
    assert f"{per_pos}{{{at.format(1)}}} 3.0" in text
