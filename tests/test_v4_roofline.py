"""DeepSeek-V4 in the roofline (bench/v4_roofline.py), on tiny-deepseek-v4's shape: a sliding, a
CSA, an HCA and a CSA layer; 64 wide, 4 heads of 32, a window of 8, entries of 4 and 8 tokens,
16 index heads of 16 keeping 3, 2 streams, 8 experts of 32 (top 2) and a shared one, layer 0
hash-routed."""

from __future__ import annotations

import torch

from splitserve.bench.roofline import (
    decode_step_bytes,
    kv_bytes_per_token,
    matmul_params,
    prefill_flops,
)
from splitserve.bench.v4_roofline import v4_weights
from splitserve.engine.layers.attention import TorchAttention
from splitserve.engine.models.deepseek_v4 import DeepseekV4ForCausalLM
from splitserve.engine.shapes import shape_config

TINY = shape_config("tiny-deepseek-v4")


def test_v4_weights_with_every_expert_are_the_built_models_parameters() -> None:
    """All but the embedding and the hash layer's tid2eid table (512 tokens x 2 experts)."""
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(TINY, TorchAttention(4, 1, 32))
    held = sum(p.numel() for p in model.parameters()) - 512 * 64 - 512 * 2
    weights = v4_weights(TINY, 8)
    assert weights.matmul + weights.norms + weights.float32 == held == 352_547


def test_v4_decode_step_reads_the_routed_experts_and_each_rows_window_and_entries() -> None:
    """Batch 2 at context 100: 3.5 experts a layer in expectation; projections 86,016
    attention values + 4 layers x 3 x 64 x (3.5 x 32 + 32) experts, norms and head 33,696,
    float32 11,651. A row reads 4 windows of 8 keys, per CSA layer 25 index keys of 16 and
    3 entries, the HCA layer's 12 entries (2,400 values)."""
    weights = (86_016 + 4 * 3 * 64 * 144) * 2 + 33_696 * 2 + 11_651 * 4
    assert decode_step_bytes(TINY, 2, 2, 100) == weights + 2 * 2_400 * 2
    assert matmul_params(TINY) == 86_016 + 4 * 3 * 64 * 96 + 4 * (2 * 8 * 128 + 8 * 64) + 256


def test_v4_kv_bytes_per_token_are_the_compressed_entries_share() -> None:
    """Tiny: 2 CSA layers x (32 + 16) / 4 + the HCA's 32 / 8; V4-Flash: 3,292 values."""
    assert kv_bytes_per_token(TINY, 2) == (2 * 12 + 4) * 2
    assert kv_bytes_per_token(shape_config("deepseek-v4-flash"), 2) == 3_292 * 2


def test_v4_prefill_flops_count_the_window_the_picked_entries_and_the_indexer() -> None:
    """16 tokens: 100 window keys a layer, 27 picked CSA entries, 10 HCA entries, 28 index
    keys scored per CSA layer; a key costs 4 x 4 heads x 32, a scored key 2 x 16 x 16."""
    attention = (4 * 100 + 2 * 27 + 10) * 512 + 2 * 28 * 512
    linear = 2.0 * matmul_params(TINY) * 16 + 2 * 512 * 64
    assert prefill_flops(TINY, 16) == linear + attention
