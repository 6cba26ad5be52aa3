"""Fused add + RMSNorm, rotary, SiLU-and-mul and the paged K/V write against their references."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels.activation import silu_and_mul, silu_and_mul_ref
from splitserve.kernels.kv_write import write_kv_cache, write_kv_cache_ref
from splitserve.kernels.rmsnorm import (
    fused_add_rms_norm,
    fused_add_rms_norm_ref,
    rms_norm,
    rms_norm_ref,
)
from splitserve.kernels.rotary import rotary_embedding, rotary_embedding_ref

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# One unit in the last place of each dtype, at magnitude ~1. Triton's interpreter rounds
# float32 -> bfloat16 by truncation (GPUs round to nearest even), so bfloat16 results may differ
# from torch's by one unit; benchmarks/kernels/triton_kernels.py checks bfloat16 on the GPU.
ULP = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float(), expected.float(), atol=ULP[dtype], rtol=ULP[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 96])
def test_rms_norm_matches_reference(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(7, hidden, dtype=dtype) * 3
    weight = torch.randn(hidden, dtype=dtype)
    _close(rms_norm(x, weight, 1e-6), rms_norm_ref(x, weight, 1e-6), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_and_residual_sum(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(2, 5, 80, dtype=dtype), torch.randn(2, 5, 80, dtype=dtype)
    weight = torch.randn(80, dtype=dtype)
    x_before, res_before = x.clone(), residual.clone()
    out, new_res = fused_add_rms_norm(x, residual, weight, 1e-5)
    ref_out, ref_res = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    if dtype == torch.bfloat16:
        _close(new_res, ref_res, dtype)
    else:
        assert torch.equal(new_res, ref_res)
    _close(out, ref_out, dtype)
    assert torch.equal(x, x_before) and torch.equal(residual, res_before)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64), (3, 1, 48)])
def test_rotary_matches_model_rotary_on_strided_qk(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(2)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    tokens = 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim)
    positions = torch.tensor([0, 1, 2, 17, 100, 255, 3, 64, 5])
    q_out, k_out = rotary_embedding(positions, q, k, rotary.cos, rotary.sin)
    q_ref, k_ref = rotary_embedding_ref(positions, q, k, rotary.cos, rotary.sin)
    model_q, model_k = rotary(positions, q, k)
    assert torch.equal(q_ref, model_q) and torch.equal(k_ref, model_k)
    _close(q_out, q_ref, dtype)
    _close(k_out, k_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [64, 200])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(3)
    x = torch.randn(6, 2 * inter, dtype=dtype) * 2
    _close(silu_and_mul(x), silu_and_mul_ref(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_kv_write_stores_every_token_at_its_slot_and_skips_padding(
    dtype: torch.dtype, block_size: int
) -> None:
    torch.manual_seed(4)
    num_blocks, kv_heads, head_dim = 6, 3, 40
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    slots = torch.tensor([5, block_size * 3 + 1, -1, block_size * 6 - 1, block_size])
    kv = torch.randn(len(slots), 2 * kv_heads, head_dim, dtype=dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views, like the model's
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_cache(k, v, k_cache, v_cache, slots)
    write_kv_cache_ref(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
