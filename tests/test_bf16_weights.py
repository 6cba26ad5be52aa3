"""The opt-in bfloat16 CPU weights (``cpu_weights="bfloat16"``, engine/layers/bf16_linear.py):
each projection equals a bfloat16 product of bfloat16-rounded operands, in float32 around it;
the mode is refused where it does not apply. Its agreement with transformers on SmolLM2 is
measured in tests/test_engine_vs_transformers.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from splitserve.bench.roofline import held_weight_bytes
from splitserve.engine.config import EngineConfig
from splitserve.engine.layers.bf16_linear import Bf16Linear, to_bf16_layers
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.model_config import MoEConfig


def test_a_bf16_projection_is_the_bf16_product_returned_in_float32() -> None:
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 40)
    x = torch.randn(2, 5, 96, generator=gen)
    layer = Bf16Linear(linear)
    out = layer(x)
    assert out.dtype == torch.float32 and out.shape == (2, 5, 40)
    expected = (x.bfloat16().float() @ linear.weight.bfloat16().float().T).bfloat16().float()
    torch.testing.assert_close(out, expected + linear.bias, rtol=1e-2, atol=1e-2)
    # Not the float32 product: the rounding is real (the mode is opt-in for that reason).
    assert not torch.allclose(out, linear(x), rtol=1e-5, atol=1e-5)
    assert torch.equal(dense(x.reshape(-1, 96), layer), out.reshape(-1, 40))


def test_to_bf16_layers_converts_every_float32_projection_and_unties_the_lm_head() -> None:
    model = nn.Module()
    model.embed = nn.Embedding(10, 16)
    model.proj = nn.Linear(16, 16, bias=False)
    model.lm_head = nn.Linear(16, 10, bias=False)
    model.lm_head.weight = model.embed.weight
    assert to_bf16_layers(model) == 2
    assert isinstance(model.proj, Bf16Linear) and isinstance(model.lm_head, Bf16Linear)
    assert model.embed.weight.dtype == torch.float32  # the lookup stays float32
    ids = torch.tensor([3, 7])
    logits = model.lm_head(model.embed(ids))
    assert logits.shape == (2, 10) and logits.dtype == torch.float32
    # The roofline counts the bfloat16 copies (held outside parameters), not the lookup table.
    model.embed_tokens = model.embed
    assert held_weight_bytes(model) == (16 * 16 + 10 * 16) * 2


def test_a_moe_layer_keeps_its_router_and_experts_and_idles() -> None:
    """The router stays float32 (its rounding would move the experts' choice); an idle
    expert-parallel pass still makes its empty float32 input."""
    model = nn.Module()
    model.moe = SparseMoE(
        16, MoEConfig(num_experts=4, top_k=2, intermediate_size=8, renormalize=True)
    )
    model.proj = nn.Linear(16, 16)
    assert to_bf16_layers(model) == 1
    assert type(model.moe.gate) is nn.Linear and model.moe.w13.dtype == torch.float32
    model.moe.idle()  # not expert-parallel here: routes zero tokens locally


@pytest.mark.parametrize(
    "overrides",
    [{"cpu_weights": "int4"}, {"cpu_weights": "bfloat16", "dtype": "bfloat16"}],
)
def test_bf16_weights_are_refused_where_they_do_not_apply(overrides: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="cpu_weights"):
        EngineConfig(**overrides)
