"""The grouped expert GEMM against its torch reference, and the MoE layer on the kernels."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.layers.moe import SparseMoE, combine, permute, route
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import MoEConfig
from splitserve.kernels.dispatch import set_kernels_on_cpu
from splitserve.kernels.grouped_gemm import (
    GemmTiles,
    grouped_gemm,
    grouped_gemm_ref,
    tile_schedule,
)
from splitserve.kernels.moe_route import route as route_kernel

# float32 dots are IEEE on the interpreter and the GPU; float16 results are rounded once.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3}


def test_tile_schedule_maps_tiles_to_experts_and_first_rows() -> None:
    # Expert rows: 0 none, 1 has 18 (two 16-row tiles), 2 has 3, 3 has 9, 4 none.
    offsets = torch.tensor([0, 0, 18, 21, 30, 30])
    schedule = tile_schedule(offsets, num_rows=30, block_m=16)
    # ceil(30 / 16) + 5 experts = 7 tiles at most; the 4 real ones first, then expert 5 (none).
    assert schedule.tolist() == [[1, 1, 2, 3, 5, 5, 5], [0, 16, 18, 21, 30, 30, 30]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gather", [True, False])
@pytest.mark.parametrize(
    "tiles", [None, GemmTiles(16, 32, 16, split_k=3)], ids=["default", "split-k"]
)
def test_grouped_gemm_matches_reference(
    dtype: torch.dtype, gather: bool, tiles: GemmTiles | None
) -> None:
    """split-k: K = 40 in 3 splits of 16 (the last one short), partial sums added after."""
    torch.manual_seed(0)
    offsets = torch.tensor([0, 0, 18, 21, 30, 30])
    weight = torch.randn(5, 70, 40, dtype=dtype) / 4
    if gather:
        x = torch.randn(11, 40, dtype=dtype)
        rows = torch.randint(0, 11, (30,))
    else:
        x, rows = torch.randn(30, 40, dtype=dtype), None
    out = grouped_gemm(x, weight, offsets, rows, tiles)
    expected = grouped_gemm_ref(x, weight, offsets, rows)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected.float(), atol=tol, rtol=tol)


def test_grouped_gemm_of_no_rows_is_empty() -> None:
    out = grouped_gemm(torch.empty(0, 8), torch.randn(2, 4, 8), torch.tensor([0, 0, 0]))
    assert out.shape == (0, 4)


def test_sparse_moe_on_the_kernels_equals_the_torch_code() -> None:
    torch.manual_seed(1)
    moe = SparseMoE(32, MoEConfig(num_experts=6, top_k=2, intermediate_size=24, renormalize=False))
    norm = RMSNorm(32, 1e-6)
    x, residual = torch.randn(9, 32), torch.randn(9, 32)
    with torch.no_grad():
        expected, expected_sum = moe(x, residual, norm)
        set_kernels_on_cpu(True)
        try:
            out, summed = moe(x, residual, norm)
        finally:
            set_kernels_on_cpu(False)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, expected_sum, atol=1e-6, rtol=1e-6)
    assert int(moe.expert_load.sum()) == 2 * 9 * 2


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (128, 8), (6, 3)])
def test_route_kernel_equals_the_torch_router(experts: int, top_k: int, renormalize: bool) -> None:
    """Softmax, top_k most probable first, renormalized or not; 6 experts pad to 8."""
    torch.manual_seed(experts + top_k)
    logits = torch.randn(5, experts) * 3
    expected = route(logits, top_k, renormalize)
    weights, chosen = route_kernel(logits, top_k, renormalize)
    assert torch.equal(chosen, expected.experts)
    torch.testing.assert_close(weights, expected.weights, atol=1e-6, rtol=1e-5)
    set_kernels_on_cpu(True)
    try:
        through_layer = route(logits, top_k, renormalize)
    finally:
        set_kernels_on_cpu(False)
    assert torch.equal(through_layer.experts, expected.experts)


@pytest.mark.parametrize(("tokens", "top_k", "experts"), [(1, 8, 128), (5, 3, 6), (16, 8, 128)])
def test_permute_kernel_equals_the_stable_sort(tokens: int, top_k: int, experts: int) -> None:
    """Order, rows and offsets as torch's stable sort gives them, repeated experts included."""
    torch.manual_seed(tokens)
    chosen = torch.stack([torch.randperm(experts)[:top_k] for _ in range(tokens)])
    chosen[-1] = chosen[0]  # two tokens on the same experts: the sort must keep token order
    expected = permute(chosen, experts)
    set_kernels_on_cpu(True)
    try:
        got = permute(chosen, experts)
    finally:
        set_kernels_on_cpu(False)
    assert torch.equal(got.order, expected.order)
    assert torch.equal(got.rows, expected.rows)
    assert torch.equal(got.offsets, expected.offsets)


@pytest.mark.parametrize(("tokens", "top_k", "hidden"), [(1, 8, 64), (5, 3, 40), (16, 8, 1100)])
def test_combine_kernel_equals_the_torch_code(tokens: int, top_k: int, hidden: int) -> None:
    """Each token's rows found through the sort order, weighted, summed in float32; a hidden
    size past one block (1100) and one that is not a power of two (40)."""
    torch.manual_seed(tokens)
    chosen = torch.stack([torch.randperm(16)[:top_k] for _ in range(tokens)])
    perm = permute(chosen, 16)
    rows = torch.randn(tokens * top_k, hidden, dtype=torch.float16)
    weights = torch.rand(tokens, top_k)
    expected = combine(rows, perm.order, weights)
    set_kernels_on_cpu(True)
    try:
        got = combine(rows, perm.order, weights)
    finally:
        set_kernels_on_cpu(False)
    torch.testing.assert_close(got.float(), expected.float(), atol=2e-3, rtol=2e-3)
