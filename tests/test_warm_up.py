"""Warm start: the eager step shapes the limits allow, run on the scratch block only."""

from __future__ import annotations

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.warm_up import batch_sizes, decode_width, decode_widths, warm_up
from splitserve.kernels.decode_attention import choose_num_splits


def test_batch_sizes_cover_each_power_of_two_and_the_limit() -> None:
    assert batch_sizes(256) == [1, 2, 3, 4, 8, 16, 17, 32, 33, 64, 65, 128, 129, 256]
    assert batch_sizes(48) == [1, 2, 3, 4, 8, 16, 17, 32, 33, 48]
    assert batch_sizes(1) == [1]


def test_eager_decode_widths_are_powers_of_two_up_to_the_longest_table() -> None:
    assert decode_widths(512) == [16, 32, 64, 128, 256, 512]
    assert decode_widths(100) == [16, 32, 64, 100]
    assert [decode_width(n, 512) for n in (1, 16, 17, 300, 512)] == [16, 16, 32, 512, 512]
    assert decode_width(7, 8) == 8
    # Every width a step can get is one that warm_up runs.
    assert {decode_width(n, 100) for n in range(1, 101)} == set(decode_widths(100))


def test_decode_attention_splits_are_powers_of_two() -> None:
    device = torch.device("cpu")
    for programs in range(1, 300, 7):
        for context in (16, 300, 4096, 100_000):
            splits = choose_num_splits(programs, context, device, 64)
            assert splits & (splits - 1) == 0 and 1 <= splits <= 32


def test_warm_up_touches_only_the_scratch_block() -> None:
    engine = LLMEngine(
        EngineConfig(model="shape:tiny-llama", max_num_seqs=4, max_model_len=512, num_kv_blocks=40)
    )
    runner = engine.runner
    before = runner.kv_cache.clone()
    seconds = warm_up(runner, max_num_seqs=4, max_prefill_tokens=64)
    assert seconds > 0
    scratch = runner.scratch_block
    changed = (runner.kv_cache != before).flatten(3).any(-1)  # [2, layers, blocks]
    assert changed[:, :, scratch].all()
    changed[:, :, scratch] = False
    assert not changed.any()
