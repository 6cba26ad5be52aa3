"""oneDNN projections on the CPU: the same float32 results as F.linear, packed once per weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers import cpu_gemm
from splitserve.engine.layers.cpu_gemm import (
    dense_gemm,
    onednn_available,
    onednn_linear,
    set_onednn_enabled,
)

pytestmark = pytest.mark.skipif(not onednn_available(), reason="this torch has no oneDNN linear")


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_onednn_linear_matches_f_linear(rows: int, bias: bool) -> None:
    torch.manual_seed(rows)
    layer = nn.Linear(576, 960, bias=bias)
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        out = onednn_linear(x, layer)
        assert out is not None and out.shape == (rows, 960)
        torch.testing.assert_close(out, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 128, 300])
def test_dense_gemm_on_a_plain_weight_matches_f_linear_and_takes_onednn(rows: int) -> None:
    """The dequantized weight's product: oneDNN on the plain (not reordered) weight, the same
    float32 result as F.linear; with oneDNN off, F.linear itself."""
    torch.manual_seed(rows)
    x, weight = torch.randn(rows, 576), torch.randn(3072, 576)
    expected = F.linear(x, weight)
    assert cpu_gemm._dense_weights_taken()
    torch.testing.assert_close(dense_gemm(x, weight), expected, rtol=1e-5, atol=1e-4)
    set_onednn_enabled(False)
    try:
        assert torch.equal(dense_gemm(x, weight), expected)
    finally:
        set_onednn_enabled(True)


def test_weight_is_packed_once_and_again_after_a_write() -> None:
    layer = nn.Linear(64, 32, bias=False)
    x = torch.randn(3, 64)
    with torch.inference_mode():
        onednn_linear(x, layer)
        first = getattr(layer, cpu_gemm._PACKED)[1]
        onednn_linear(x, layer)
        assert getattr(layer, cpu_gemm._PACKED)[1] is first
        with torch.no_grad():
            layer.weight.mul_(2.0)
        out = onednn_linear(x, layer)
    assert getattr(layer, cpu_gemm._PACKED)[1] is not first
    assert out is not None
    torch.testing.assert_close(out, F.linear(x, layer.weight), rtol=1e-5, atol=1e-5)


def test_only_float32_cpu_tensors_and_only_when_enabled() -> None:
    layer = nn.Linear(16, 8)
    assert onednn_linear(torch.randn(2, 16, dtype=torch.float64), layer) is None
    set_onednn_enabled(False)
    try:
        assert onednn_linear(torch.randn(2, 16), layer) is None
    finally:
        set_onednn_enabled(True)
    assert onednn_linear(torch.randn(2, 16), layer) is not None


def test_prepack_packs_every_projection_of_a_model_at_load() -> None:
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8, bias=False))
    assert cpu_gemm.prepack(model) == 2
    first = getattr(model[0], cpu_gemm._PACKED)[1]
    x = torch.randn(4, 16)
    with torch.inference_mode():
        out = onednn_linear(x, model[0])
    assert getattr(model[0], cpu_gemm._PACKED)[1] is first  # no second packing
    assert out is not None
    torch.testing.assert_close(out, model[0](x), rtol=1e-5, atol=1e-5)
