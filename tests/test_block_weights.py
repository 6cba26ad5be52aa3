"""GGUF weights kept in their quantized blocks on the CPU, and the measured choice of product."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
import torch
from torch import nn

from splitserve import LLM, SamplingParams
from splitserve.engine.layers.block_linear import BlockEmbedding, BlockLinear, to_block_layers
from splitserve.engine.layers.cpu_gemm import (
    onednn_available,
    onednn_linear,
    set_onednn_choice,
)
from splitserve.engine.layers.projection_choice import F_LINEAR, choose_cpu_paths, pick
from splitserve.kernels.native.blocks import Q4_1, Q8_0, dequantize_ref, native_available

pytestmark = pytest.mark.skipif(not native_available(), reason="no C compiler here")


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 64)
        self.proj = nn.Linear(64, 96, bias=False)
        self.lm_head = nn.Linear(64, 10, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def test_to_block_layers_swaps_projections_and_keeps_the_tie() -> None:
    model = _Tied()
    assert to_block_layers(model, {"embed_tokens.weight": Q8_0, "proj.weight": Q4_1}) == 2
    assert isinstance(model.embed_tokens, BlockEmbedding)
    assert isinstance(model.proj, BlockLinear) and model.proj.weight.shape == (96, 2 * 20)
    assert isinstance(model.lm_head, BlockLinear)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert (model.lm_head.in_features, model.lm_head.out_features) == (64, 10)


def test_block_linear_past_its_native_rows_takes_the_dequantized_gemm() -> None:
    layer = BlockLinear(64, 8, Q4_1)
    gen = torch.Generator().manual_seed(0)
    layer.weight.data = torch.randint(0, 256, (8, 40), dtype=torch.uint8, generator=gen)
    # Finite scales: d = m = 1.0 (fp16 0x3c00) in every block.
    layer.weight.data.view(8, 2, 20)[..., 0:4] = torch.tensor([0, 0x3C, 0, 0x3C], dtype=torch.uint8)
    x = torch.randn(5, 64, generator=gen)
    expected = x @ dequantize_ref(layer.weight, Q4_1).T
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
    layer.dequantize_from = 4
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)


def test_pick_takes_the_choice_of_the_largest_measured_count_not_above() -> None:
    table = ((1, "a"), (16, "b"), (128, "a"))
    assert [pick(table, rows) for rows in (1, 15, 16, 127, 128, 4096)] == list("aabbaa")


@pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear")
def test_a_layer_that_never_takes_onednn_drops_its_packed_copy() -> None:
    layer = nn.Linear(32, 16)
    x = torch.randn(3, 32)
    assert onednn_linear(x, layer) is not None
    set_onednn_choice(layer, lambda rows: rows >= 8, ever=True)
    assert onednn_linear(x, layer) is None
    assert onednn_linear(torch.randn(8, 32), layer) is not None
    set_onednn_choice(layer, lambda rows: False, ever=False)
    assert not hasattr(layer, "_splitserve_onednn")
    assert onednn_linear(x, layer) is None


def test_choose_cpu_paths_times_each_shape_once_and_logs_it(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = nn.Sequential(nn.Linear(64, 32), nn.Linear(64, 32), nn.Linear(32, 64))
    with caplog.at_level(logging.INFO, logger="splitserve.engine.layers.projection_choice"):
        choices = choose_cpu_paths(model)
    assert sorted((c.shape, c.modules) for c in choices) == [("f32 32x64", 2), ("f32 64x32", 1)]
    assert all(sorted(c.micros) == [1, 16, 128] for c in choices)
    assert sum("projection f32" in r.message for r in caplog.records) == 2
    for module in model:
        choice = next(
            c for c in choices if c.shape == f"f32 {module.out_features}x{module.in_features}"
        )
        for rows in (1, 16, 200):
            took_onednn = onednn_linear(torch.randn(rows, module.in_features), module) is not None
            assert took_onednn == (pick(choice.table, rows) != F_LINEAR)


@pytest.mark.slow
def test_smollm2_default_mode_keeps_the_files_blocks(smollm2_llm: LLM) -> None:
    model = smollm2_llm.engine.runner.model
    layer = model.layers[0]
    projections = [layer.self_attn.qkv_proj, layer.self_attn.o_proj]
    projections += [layer.mlp.gate_up_proj, layer.mlp.down_proj]
    assert all(isinstance(p, BlockLinear) and p.qtype == Q4_1 for p in projections)
    assert isinstance(model.embed_tokens, BlockEmbedding) and model.embed_tokens.qtype == Q8_0
    assert model.lm_head.weight is model.embed_tokens.weight
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes < 110e6  # 540 MB as float32


@pytest.mark.slow
def test_smollm2_block_mode_logits_equal_float32_mode_to_rounding(
    smollm2_llm: LLM, make_llm: Callable[..., LLM]
) -> None:
    prompt = smollm2_llm.tokenizer.encode("The three primary colors are")
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=5)
    blocks = smollm2_llm.generate([prompt], params)[0].outputs[0]
    dense_llm = make_llm(dtype="float32")
    assert dense_llm.engine.runner.model.native_decode is None  # float32 takes the modules
    dense = dense_llm.generate([prompt], params)[0].outputs[0]
    assert blocks.token_ids == dense.token_ids
    top_blocks, top_dense = blocks.logprobs[0], dense.logprobs[0]
    assert set(top_blocks) == set(top_dense)
    for token, entry in top_blocks.items():
        assert abs(entry.logprob - top_dense[token].logprob) < 1e-3
