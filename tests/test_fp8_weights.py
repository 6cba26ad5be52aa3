"""FP8 weights (``quantization="fp8"``, engine/layers/fp8_linear.py): the decoder layers'
projections and routed experts hold e4m3 blocks with their scales, the rest keeps its dtype,
and a model's logits stay within FP8's rounding of the same model on the dequantized weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.fp8_linear import Fp8Linear
from splitserve.engine.layers.moe import SparseMoE
from splitserve.kernels.fp8_quant import (
    BlockFp8,
    dequantize_blocks,
    dequantize_groups,
    quantize_blocks,
    quantize_groups,
)
from tests.support.reference import prompt_logits
from tests.support.tiny_models import CALM, tiny_deepseek_v3, tiny_llm, tiny_model, tiny_qwen3_moe


def test_quantize_blocks_scales_each_block_to_the_largest_e4m3() -> None:
    """A [300, 200] weight: 3 x 2 blocks, the last partial; every block's largest magnitude
    is 448 after scaling, and the dequantized weight is within e4m3's rounding."""
    weight = torch.randn(300, 200, generator=torch.Generator().manual_seed(0))
    weight[130, 140] = 50.0  # block (1, 1)'s scale is set by this one value
    q = quantize_blocks(weight)
    assert q.data.dtype == torch.float8_e4m3fn and q.scale.shape == (3, 2)
    assert q.scale[1, 1].item() == pytest.approx(50.0 / 448)
    assert q.data[130, 140].float().item() == 448.0
    assert (dequantize_blocks(q) - weight).abs().max() <= weight.abs().max() / 16
    assert (dequantize_blocks(q) - weight).norm() / weight.norm() < 0.04


def test_an_fp8_projection_is_the_product_of_its_dequantized_operands() -> None:
    """Fp8Linear (bias included) on 72 rows (more than W8A16_MAX_ROWS) = the input rounded per
    token and 128-channel group times the dequantized weight, in float32: the only rounding is
    the operands'; on 12 rows (decode-sized) the input is not rounded."""
    gen = torch.Generator().manual_seed(2)
    linear = nn.Linear(200, 72)
    layer = Fp8Linear(200, 72, linear.bias)
    quantized = quantize_blocks(linear.weight.detach())
    layer.weight.data, layer.weight_scale_inv.data = quantized.data, quantized.scale
    real = dequantize_blocks(quantized)
    x = torch.randn(6, 12, 200, generator=gen)
    out = layer(x)
    x_fp8, x_scale = quantize_groups(x.reshape(72, 200))
    rounded = dequantize_groups(x_fp8, x_scale)
    expected = rounded @ real.T + linear.bias
    assert out.shape == (6, 12, 72)
    torch.testing.assert_close(out.reshape(72, 72), expected, rtol=1e-6, atol=1e-6)
    assert (rounded - x.reshape(72, 200)).norm() / x.norm() < 0.04
    few = layer(x[0])
    torch.testing.assert_close(few, x[0] @ real.T + linear.bias, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(few, expected[:12], rtol=1e-4, atol=1e-4)


def dequantize_into(reference: nn.Module, fp8: nn.Module) -> int:
    """Gives the float model the FP8 model's weights, dequantized; returns how many."""
    done = 0
    ours = dict(fp8.named_modules())
    with torch.no_grad():
        for name, module in reference.named_modules():
            held = ours[name]
            if isinstance(held, Fp8Linear):
                weight = BlockFp8(held.weight, held.weight_scale_inv)
                module.weight.copy_(dequantize_blocks(weight))
                done += 1
            elif isinstance(held, SparseMoE):
                for part, weight in zip(("w13", "w2"), held.expert_weights(), strict=True):
                    assert isinstance(weight, BlockFp8)
                    getattr(module, part).copy_(dequantize_blocks(weight))
                done += 1
    return done


FAMILIES = {
    "llama": lambda tok, path: tiny_model(tok, path, "llama", seed=1, **CALM),
    "qwen3_moe": lambda tok, path: tiny_qwen3_moe(tok, path, **CALM),
    "deepseek_v3": lambda tok, path: tiny_deepseek_v3(tok, path, **CALM),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_fp8_logits_track_the_dequantized_weights(
    family: str, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    """The same model with FP8 weights and with their dequantized float32 values: only the
    activations' per-token-group rounding differs (the weights' products are exact,
    ``test_an_fp8_projection_is_the_product_of_its_dequantized_operands``). Stated
    tolerance: the logits' RMS error under 12% of their RMS spread around each position's
    mean (measured 5.7% llama, 4.0% qwen3_moe, 8.0% deepseek_v3), the top token equal at
    12 of the 16 positions or more (measured 12, 14, 14)."""
    _, path = FAMILIES[family](smollm2_tokenizer, tmp_path)
    fp8 = tiny_llm(path, smollm2_tokenizer, max_model_len=64, block_size=8, quantization="fp8")
    reference = tiny_llm(path, smollm2_tokenizer, max_model_len=64, block_size=8)
    converted = dequantize_into(reference.engine.runner.model, fp8.engine.runner.model)
    model = fp8.engine.runner.model
    assert type(model.lm_head) is nn.Linear and model.lm_head.weight.dtype == torch.float32
    assert converted == sum(isinstance(m, Fp8Linear | SparseMoE) for m in model.modules())
    got, expected = prompt_logits(fp8), prompt_logits(reference)
    spread = (expected - expected.mean(dim=-1, keepdim=True)).norm()
    assert (got - expected).norm() / spread < 0.12
    assert int((got.argmax(-1) == expected.argmax(-1)).sum()) >= 12


def test_fp8_is_refused_where_it_is_not_built() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int8")
    with pytest.raises(ValueError, match="expert_parallel_size"):
        EngineConfig(quantization="fp8", expert_parallel_size=2)
