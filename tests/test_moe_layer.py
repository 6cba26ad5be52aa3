"""The MoE layer's pieces on hand-made inputs: routing, permutation, combine, grouped GEMM,
the expert-load counter, and the shape configs of the MoE families."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from splitserve.engine.layers.moe import (
    SparseMoE,
    combine,
    experts_forward,
    grouped_gemm,
    permute,
    route,
)
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import ModelConfig, MoEConfig
from splitserve.engine.shapes import SHAPES


def test_route_takes_softmax_top_k_with_and_without_renormalization() -> None:
    logits = torch.tensor([[0.0, math.log(2.0), math.log(3.0), math.log(4.0)]])
    plain = route(logits, 2, renormalize=False)
    assert plain.experts.tolist() == [[3, 2]]
    assert torch.allclose(plain.weights, torch.tensor([[0.4, 0.3]]))
    renormalized = route(logits, 2, renormalize=True)
    assert renormalized.experts.tolist() == [[3, 2]]
    assert torch.allclose(renormalized.weights, torch.tensor([[4 / 7, 3 / 7]]))
    assert renormalized.weights.dtype == torch.float32


def test_permute_sorts_token_slots_by_expert_stably() -> None:
    experts = torch.tensor([[2, 0], [0, 3], [2, 1]])
    perm = permute(experts, num_experts=5)
    assert perm.order.tolist() == [1, 2, 5, 0, 4, 3]
    assert perm.rows.tolist() == [0, 1, 2, 0, 2, 1]
    assert perm.offsets.tolist() == [0, 2, 3, 5, 6, 6]
    assert perm.counts.tolist() == [2, 1, 2, 1, 0]


def test_combine_weights_each_tokens_rows_back_in_slot_order() -> None:
    experts = torch.tensor([[1, 0], [0, 1]])
    perm = permute(experts, num_experts=2)
    # Sorted rows: expert 0 serves (token 0, slot 1), (token 1, slot 0); expert 1 the others.
    sorted_out = torch.tensor([[1.0], [2.0], [10.0], [20.0]])
    weights = torch.tensor([[0.75, 0.25], [0.5, 0.5]])
    out = combine(sorted_out, perm.order, weights)
    assert out.tolist() == [[10.0 * 0.75 + 1.0 * 0.25], [2.0 * 0.5 + 20.0 * 0.5]]


def test_grouped_gemm_multiplies_each_row_by_its_experts_weight() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(4, 8, generator=generator)
    weight = torch.randn(3, 5, 8, generator=generator)
    rows = torch.tensor([3, 0, 0, 2, 1])
    offsets = torch.tensor([0, 2, 2, 5])
    out = grouped_gemm(x, weight, offsets, rows)
    expected = torch.stack([weight[e] @ x[r] for r, e in zip(rows.tolist(), [0, 0, 2, 2, 2])])
    assert torch.allclose(out, expected, atol=1e-6)


def test_sparse_moe_equals_a_per_token_loop_and_counts_expert_load() -> None:
    torch.manual_seed(0)
    moe = SparseMoE(16, MoEConfig(num_experts=4, top_k=2, intermediate_size=12, renormalize=True))
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(5, 16)
    with torch.no_grad():
        out, residual = moe(x, None, norm)
        h = norm(x)
        routing = route(moe.gate(h), 2, True)
        expected = torch.zeros_like(x)
        for t in range(5):
            for slot in range(2):
                e = int(routing.experts[t, slot])
                gate, up = F.linear(h[t], moe.w13[e]).chunk(2)
                expected[t] += routing.weights[t, slot] * F.linear(F.silu(gate) * up, moe.w2[e])
    assert torch.allclose(out, expected, atol=1e-5)
    assert torch.equal(residual, x)
    assert (
        moe.expert_load.tolist() == torch.bincount(routing.experts.flatten(), minlength=4).tolist()
    )
    assert int(moe.expert_load.sum()) == 10


def test_experts_forward_with_no_tokens_returns_an_empty_batch() -> None:
    w13, w2 = torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    routing = route(torch.empty(0, 4), 2, False)
    out = experts_forward(torch.empty(0, 8), w13, w2, routing, permute(routing.experts, 4))
    assert out.shape == (0, 8)


def test_moe_configs_from_hf_and_shapes() -> None:
    base = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_experts_per_tok": 2,
    }
    mixtral = ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 8})
    assert mixtral.moe == MoEConfig(8, 2, 128, renormalize=True)
    assert not mixtral.qk_norm
    qwen = ModelConfig.from_hf(
        {
            **base,
            "model_type": "qwen3_moe",
            "num_experts": 16,
            "moe_intermediate_size": 32,
            "decoder_sparse_step": 2,
            "mlp_only_layers": [3],
        }
    )
    assert qwen.moe == MoEConfig(16, 2, 32, renormalize=False, dense_layers=(0, 2, 3))
    assert qwen.qk_norm
    assert SHAPES["qwen3-30b-a3b"].moe == MoEConfig(128, 8, 768, renormalize=True)
    assert SHAPES["mixtral-8x7b"].moe == MoEConfig(8, 2, 14336, renormalize=True)
    with pytest.raises(ValueError, match="top_k"):
        MoEConfig(4, 5, 8, renormalize=True)
