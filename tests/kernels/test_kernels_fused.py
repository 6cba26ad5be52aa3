"""The decode kernels against their references: the batch-1 GEMV with norm and SiLU fused in,
the fused rotary + K/V write and the two-launch argmax; then the whole model on every kernel."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("triton")

from splitserve import LLM, SamplingParams
from splitserve.engine.layers.attention import write_kv
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.kernels import gemv as gemv_module
from splitserve.kernels.argmax import argmax_rows
from splitserve.kernels.decode_attention import (
    paged_decode_attention,
    paged_decode_attention_qkv,
)
from splitserve.kernels.dispatch import set_decode_path, set_kernels_on_cpu
from splitserve.kernels.fp8_quant import FP8, KV_SCALE_VALUES, quantize_blocks
from splitserve.kernels.gemv import Tiles, gemv, gemv_ref
from splitserve.kernels.kv_write import write_kv_cache_ref
from splitserve.kernels.rotary import rotary_embedding_ref, rotary_kv_write
from tests.support.tiny_models import tiny_llm, tiny_model

# Triton's interpreter computes bfloat16 dots on raw bits: bfloat16 runs on the GPU only
# (benchmarks/gpu/fastpath.py checks it there).
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(
    ("n", "k", "gated", "residual", "norm", "bias"),
    [
        (96, 80, False, False, False, False),
        (200, 300, True, True, True, False),
        (48, 64, False, True, True, True),
        (40, 72, False, False, True, True),
        (33, 130, True, False, True, False),
        (70, 100, True, False, False, False),
    ],
)
def test_gemv_matches_the_separate_ops(
    dtype: torch.dtype, n: int, k: int, gated: bool, residual: bool, norm: bool, bias: bool
) -> None:
    torch.manual_seed(n * 1000 + k)
    x = torch.randn(1, k, dtype=dtype)
    weight = torch.randn((2 if gated else 1) * n, k, dtype=dtype) / k**0.5
    res = torch.randn_like(x) if residual else None
    norm_weight = torch.randn(k, dtype=dtype) if norm else None
    b = torch.randn(n, dtype=dtype) if bias else None
    x_before = x.clone()
    # Tiles smaller than the shapes, so that K and N both take several (ragged) tiles.
    out, summed = gemv(
        x, weight, b, residual=res, norm_weight=norm_weight, gated=gated, tiles=Tiles(16, 32, 4)
    )
    ref, ref_summed = gemv_ref(x, weight, b, residual=res, norm_weight=norm_weight, gated=gated)
    assert out.shape == (1, n)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    if residual:
        assert summed is not None and ref_summed is not None
        assert torch.equal(summed, ref_summed)
    else:
        assert summed is None
    assert torch.equal(x, x_before)


@pytest.mark.parametrize(
    ("n", "k", "gated", "residual"),
    [(192, 300, False, False), (256, 200, True, True), (128, 130, True, False)],
)
def test_gemv_on_fp8_weights_equals_the_dequantized_product(
    n: int, k: int, gated: bool, residual: bool
) -> None:
    """FP8 blocks (one scale per 128 x 128) with ragged K tiles and a gate|up pair whose up
    half starts in another block row: the product of the row with the dequantized weight."""
    torch.manual_seed(n + k)
    x = torch.randn(1, k)
    real = torch.randn((2 if gated else 1) * n, k) / k**0.5
    real[:, : k // 3] *= 8  # blocks of different scales
    weight = quantize_blocks(real)
    res = torch.randn_like(x) if residual else None
    norm_weight = torch.randn(k)
    fused = {"residual": res, "norm_weight": norm_weight, "gated": gated}
    out, _ = gemv(x, weight.data, weight_scale=weight.scale, tiles=Tiles(16, 64, 4), **fused)
    ref, _ = gemv_ref(x, weight.data, weight_scale=weight.scale, **fused)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # against the float weights: only FP8's rounding of the weights
    plain, _ = gemv_ref(x, real, **fused)
    assert 1e-3 < ((out - plain).norm() / plain.norm()).item() < 0.1


def test_gemv_takes_one_row_and_a_residual_only_with_a_norm() -> None:
    with pytest.raises(AssertionError):
        gemv(torch.randn(2, 32), torch.randn(16, 32))
    with pytest.raises(AssertionError, match="residual"):
        gemv(torch.randn(1, 32), torch.randn(16, 32), residual=torch.randn(1, 32))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64), (3, 1, 48)])
def test_rotary_kv_write_equals_rotary_then_write(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(heads + head_dim)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    block_size, num_blocks, tokens = 16, 8, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 5, 17, 100, 255, 3])
    slots = torch.tensor([3, 40, -1, 127, 16, 0])  # -1: a padding row, skipped
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    q = rotary_kv_write(positions, qkv, heads, rotary.cos, rotary.sin, k_cache, v_cache, slots)

    q_in, k_in, v_in = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q_expected, k_rot = rotary_embedding_ref(
        positions,
        q_in.view(tokens, heads, head_dim),
        k_in.view(tokens, kv_heads, head_dim),
        rotary.cos,
        rotary.sin,
    )
    write_kv_cache_ref(k_rot, v_in.reshape(tokens, kv_heads, head_dim), k_ref, v_ref, slots)
    tol = TOL[dtype] if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(q.float(), q_expected.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), k_ref.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, v_ref)


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64), (3, 1, 48)])
def test_rotary_kv_write_into_an_fp8_cache_packs_rows_as_the_torch_write(
    heads: int, kv_heads: int, head_dim: int
) -> None:
    """Over an FP8 cache the launch quantizes each rotated K row and each V row as
    ``fp8_kv.pack_kv`` does: the same e4m3 bytes, the same scale, the padding untouched
    (float32 activations: the rotation's own rounding is the torch code's)."""
    torch.manual_seed(heads * head_dim)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    block_size, num_blocks, tokens = 16, 8, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3
    positions = torch.tensor([0, 5, 17, 100, 255, 3])
    slots = torch.tensor([3, 40, -1, 127, 16, 0])
    width = head_dim + KV_SCALE_VALUES
    k_cache = torch.zeros(num_blocks, block_size, kv_heads, width, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()

    rotary_kv_write(
        positions, qkv, heads, rotary.cos, rotary.sin, k_cache.view(FP8), v_cache.view(FP8),
        slots,
    )  # fmt: skip

    q_in, k_in, v_in = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    _, k_rot = rotary_embedding_ref(
        positions, q_in.view(tokens, heads, head_dim), k_in.view(tokens, kv_heads, head_dim),
        rotary.cos, rotary.sin,
    )  # fmt: skip
    written = slots >= 0
    v_rows = v_in.reshape(tokens, kv_heads, head_dim)
    write_kv(k_rot[written], v_rows[written], k_ref.view(FP8), v_ref.view(FP8), slots[written])
    flat = (-1, kv_heads, width)
    for cache, ref in ((k_cache, k_ref), (v_cache, v_ref)):
        got, want = cache.view(flat)[slots[written]], ref.view(flat)[slots[written]]
        assert torch.equal(got, want)
        assert cache.view(flat)[slots[written]][..., head_dim + 4 :].eq(0).all()


def test_an_fp8_rows_scale_reads_no_masked_lanes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A masked load without ``other`` leaves its lanes undefined on the GPU (the interpreter
    gives zeros): made large here, a head_dim under its power of two (48 of 64 lanes) must still
    give each row's scale from its own values only."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_masked_load"):
        pytest.skip("this Triton's interpreter has no create_masked_load to patch")
    plain = builder.create_masked_load

    def undefined_lanes(self: Any, ptrs: Any, mask: Any, other: Any, *args: Any) -> Any:
        if other is None:
            dtype = interpreter._get_np_dtype(ptrs.get_element_ty())
            other = interpreter.TensorHandle(
                interpreter.np.full_like(ptrs.data, 1e4, dtype=dtype),
                ptrs.get_element_ty(),
            )
        return plain(self, ptrs, mask, other, *args)

    monkeypatch.setattr(builder, "create_masked_load", undefined_lanes)
    heads, kv_heads, head_dim, tokens = 3, 1, 48, 2
    rotary = RotaryEmbedding(head_dim, 64, 10000.0, None)
    qkv = torch.randn(
        tokens, (heads + 2 * kv_heads) * head_dim, generator=torch.Generator().manual_seed(1)
    )
    k_cache = torch.zeros(2, 16, kv_heads, head_dim + KV_SCALE_VALUES, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([0, 17])
    rotary_kv_write(
        torch.tensor([0, 17]), qkv, heads, rotary.cos, rotary.sin, k_cache.view(FP8),
        v_cache.view(FP8), slots,
    )  # fmt: skip
    v_rows = qkv[:, (heads + kv_heads) * head_dim :].reshape(tokens, kv_heads, head_dim)
    flat = v_cache.view(-1, kv_heads, head_dim + KV_SCALE_VALUES)[slots]
    scales = flat[..., head_dim : head_dim + 4].contiguous().view(torch.float32)[..., 0]
    torch.testing.assert_close(scales, v_rows.abs().amax(-1) / 448, rtol=1e-6, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 4, 32), (6, 2, 64), (3, 1, 48)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_attention_from_qkv_equals_rotary_kv_write_then_attention(
    dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int, num_splits: int
) -> None:
    torch.manual_seed(heads * 100 + head_dim + num_splits)
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None)
    block_size, num_blocks = 16, 48
    contexts = [1, 37, 130, 64, 5]  # the last row is padding: slot -1, nothing written
    tables = torch.randperm(num_blocks)[: 5 * 9].view(5, 9)
    lens = torch.tensor(contexts)
    positions = lens - 1
    slots = tables.gather(1, (positions // block_size)[:, None])[:, 0] * block_size
    slots = slots + positions % block_size
    slots[-1] = -1
    qkv = torch.randn(len(contexts), (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    scale = head_dim**-0.5

    out = paged_decode_attention_qkv(
        qkv, heads, positions, rotary.cos, rotary.sin, slots, k_cache, v_cache, tables, lens,
        scale, num_splits=num_splits, block_n=16,
    )  # fmt: skip

    q = rotary_kv_write(positions, qkv, heads, rotary.cos, rotary.sin, k_ref, v_ref, slots)
    ref = paged_decode_attention(
        q, k_ref, v_ref, tables, lens, scale, num_splits=num_splits, block_n=16
    )
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("chunk", [64, 1024])
def test_argmax_rows_takes_the_first_maximum_like_torch(chunk: int) -> None:
    torch.manual_seed(5)
    logits = torch.randn(5, 3000)
    logits[1, 2999] = 40.0  # the last column, in a ragged chunk
    logits[2, 70] = logits[2, 2500] = 40.0  # a tie across chunks: the first wins
    logits[3] = 0.0  # all equal: index 0
    logits[4, :10] = float("-inf")
    assert torch.equal(argmax_rows(logits, chunk), logits.argmax(-1))
    assert torch.equal(argmax_rows(logits.half(), chunk), logits.half().argmax(-1))


@pytest.mark.parametrize(
    ("family", "path", "quantization"),
    [
        ("llama", "fused", None),
        ("qwen2", "fused", None),
        ("llama", "gemv", None),
        ("llama", "fused", "fp8"),
    ],
)
def test_model_on_every_kernel_gives_the_torch_tokens(
    smollm2_tokenizer: Any,
    tmp_path: Path,
    family: str,
    path: str,
    quantization: str | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Batch-1 decode steps take the GEMV path ("fused": norm and SiLU inside, "gemv": SiLU
    inside; FP8 weights with their scales), prefill steps the separate kernels (FP8: the
    FP8 GEMM); greedy tokens must equal the torch code's."""
    # q/k/v biases (Qwen2): the GEMV's bias epilogue.
    _, model = tiny_model(
        smollm2_tokenizer, tmp_path / family, family, hidden_size=96, intermediate_size=160,
        num_attention_heads=6, max_position_embeddings=256,
    )  # fmt: skip
    generator = torch.Generator().manual_seed(7)
    # A decode crossing a block boundary (12 -> 17), a prefill over two blocks (21); the
    # interpreter runs each program in Python, so the run is kept this short.
    prompts = [torch.randint(3, 40000, (n,), generator=generator).tolist() for n in (12, 21)]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    kwargs: dict[str, Any] = dict(max_model_len=96, block_size=16, num_kv_blocks=24)
    kwargs["quantization"] = quantization
    reference = tiny_llm(model, smollm2_tokenizer, **kwargs)
    expected = [
        reference.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts
    ]
    calls: list[bool] = []

    def counted(x: torch.Tensor, *args: Any, **kw: Any) -> Any:
        calls.append(kw.get("norm_weight") is not None)
        return gemv(x, *args, **kw)

    monkeypatch.setattr(gemv_module, "gemv", counted)
    set_kernels_on_cpu(True)
    set_decode_path(path)
    try:
        llm = tiny_llm(model, smollm2_tokenizer, **kwargs, attention_backend="triton")
        tokens = [
            llm.generate([p], params, use_tqdm=False)[0].outputs[0].token_ids for p in prompts
        ]
    finally:
        set_kernels_on_cpu(False)
        set_decode_path("fused")
    assert tokens == expected
    assert all(len(t) == 6 for t in expected)
    # 2 prompts x 5 decode steps x 2 layers x 4 projections, 2 of them after a norm.
    assert len(calls) == 2 * 5 * 2 * 4
    assert calls.count(True) == (2 * 5 * 2 * 2 if path == "fused" else 0)


def _greedy(llm: LLM, prompt: list[int], params: SamplingParams) -> list[int]:
    """One prompt alone, so that its decode steps have one row."""
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
