"""Paged decode and prefill attention kernels, and the triton backend, against torch."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment, TorchAttention
from splitserve.engine.layers.attention_backends import make_backend
from splitserve.engine.layers.fp8_kv import pack_kv, unpack_kv
from splitserve.kernels.decode_attention import paged_decode_attention, paged_decode_attention_ref
from splitserve.kernels.prefill_attention import (
    paged_prefill_attention,
    paged_prefill_attention_ref,
)

# Triton's interpreter computes bfloat16 dots on raw bits: bfloat16 runs on the GPU only.
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}
SHAPES = [(4, 4, 32), (12, 4, 64), (6, 2, 48), (8, 2, 16)]  # heads, kv heads, head dim


def _paged_cache(
    num_blocks: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, block_size, kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype), torch.randn(shape, dtype=dtype)


def _tables(contexts: list[int], block_size: int, num_blocks: int) -> torch.Tensor:
    """Distinct random blocks per sequence, padded with block 0 to the longest."""
    width = max(-(-c // block_size) for c in contexts)
    ids = torch.randperm(num_blocks)
    tables = torch.zeros(len(contexts), width, dtype=torch.long)
    used = 0
    for row, context in enumerate(contexts):
        count = -(-context // block_size)
        tables[row, :count] = ids[used : used + count]
        used += count
    return tables


def pairwise(splits: list[int]) -> list[tuple[int, int, int, int, int, torch.dtype]]:
    """(splits, heads, kv heads, head dim, block size, dtype) cases: every split count with
    every shape, and the block size and the dtype alternated so that every pair of values of
    any two parameters is in some case (the whole product, four times as many cases, ran 60 s
    in the interpreter)."""
    dtypes = list(TOL)
    return [
        (n, *shape, (16, 32)[(i + j) % 2], dtypes[(i // 2 + j) % 2])
        for i, shape in enumerate(SHAPES)
        for j, n in enumerate(splits)
    ]


@pytest.mark.parametrize(
    ("num_splits", "heads", "kv_heads", "head_dim", "block_size", "dtype"), pairwise([1, 3, 8])
)
def test_paged_decode_attention_matches_reference(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int, num_splits: int
) -> None:
    torch.manual_seed(block_size + heads + num_splits)
    contexts = [1, 37, 130, 64]
    k_cache, v_cache = _paged_cache(24, block_size, kv_heads, head_dim, dtype)
    tables = _tables(contexts, block_size, 24)
    lens = torch.tensor(contexts)
    q = torch.randn(len(contexts), heads, head_dim, dtype=dtype)
    scale = head_dim**-0.5
    out = paged_decode_attention(q, k_cache, v_cache, tables, lens, scale, num_splits=num_splits)
    ref = paged_decode_attention_ref(q, k_cache, v_cache, tables, lens, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "block_size", "dtype"),
    [case[1:] for case in pairwise([1, 2])],  # every shape with both block sizes and dtypes
)
def test_paged_prefill_attention_with_cached_prefix_matches_reference(
    dtype: torch.dtype, block_size: int, heads: int, kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(block_size + heads)
    segments = [(5, 5), (20, 53), (1, 30), (40, 40)]  # (new tokens, context length)
    starts = [3]  # rows before the first segment stand for decode tokens
    for length, _ in segments[:-1]:
        starts.append(starts[-1] + length)
    total = starts[-1] + segments[-1][0]
    k_cache, v_cache = _paged_cache(24, block_size, kv_heads, head_dim, dtype)
    tables = _tables([c for _, c in segments], block_size, 24)
    q = torch.randn(total, heads, head_dim, dtype=dtype)
    q_starts = torch.tensor(starts)
    q_lens = torch.tensor([length for length, _ in segments])
    lens = torch.tensor([c for _, c in segments])
    args = (q, k_cache, v_cache, tables, q_starts, q_lens, lens)
    scale = head_dim**-0.5
    out = paged_prefill_attention(*args, 40, scale, out=torch.zeros_like(q), block_m=16, block_n=16)
    ref = paged_prefill_attention_ref(*args, scale)
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("fp8", [False, True], ids=["float32", "fp8-cache"])
def test_triton_backend_matches_torch_backend_on_a_mixed_step(fp8: bool) -> None:
    """Two decoding sequences, one fresh prompt and one chunk after a cached prefix. FP8: the
    cache holds e4m3 rows and their scales (layers/fp8_kv.py), which both backends write the
    same way and the kernels dequantize as they load them."""
    torch.manual_seed(5)
    heads, kv_heads, head_dim, block_size = 6, 2, 32, 16
    k_cache, v_cache = _paged_cache(16, block_size, kv_heads, head_dim, torch.float32)
    if fp8:
        k_cache, v_cache = pack_kv(k_cache), pack_kv(v_cache)
    decode_lens, prefill = [20, 45], [(12, 12), (9, 40)]  # (new tokens, context length)
    tables = _tables(decode_lens + [c for _, c in prefill], block_size, 16)
    segments, slots, row = [], [], len(decode_lens)
    for seq, context in enumerate(decode_lens):
        slots.append(_slot(tables[seq], context - 1, block_size))
    for seq, (length, context) in enumerate(prefill, start=len(decode_lens)):
        table = tables[seq, : -(-context // block_size)]
        segments.append(PrefillSegment(row, length, context, table))
        slots += [_slot(table, p, block_size) for p in range(context - length, context)]
        row += length
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(decode_lens),
        decode_block_tables=tables[: len(decode_lens), : -(-45 // block_size)],
        decode_context_lens=torch.tensor(decode_lens),
        prefills=segments,
    )
    q = torch.randn(row, heads, head_dim)
    k, v = torch.randn(row, kv_heads, head_dim), torch.randn(row, kv_heads, head_dim)
    backend = make_backend("triton", heads, kv_heads, head_dim)
    caches = k_cache.clone(), v_cache.clone()
    out = backend.forward(q, k, v, *caches, meta)
    ref = TorchAttention(heads, kv_heads, head_dim).forward(q, k, v, k_cache, v_cache, meta)
    for got, expected in zip(caches, (k_cache, v_cache), strict=True):
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8))
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("magnitude", [1.0, 1e-4])
def test_decode_over_an_fp8_cache_matches_the_dequantized_cache(
    dtype: torch.dtype, magnitude: float
) -> None:
    """The decode kernel over e4m3 rows and their scales equals the reference over the rows
    dequantized, also for small values (at 1e-4 the softmax weights times the values' scales
    fall below float16's normal range: the weights meet the scales over the tile's largest).
    Half-precision queries run their dots in float16 (bfloat16's too: the interpreter takes
    those, not bfloat16 dots), the query scaled by a power of two."""
    torch.manual_seed(11)
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    k_cache, v_cache = _paged_cache(12, block_size, kv_heads, head_dim, torch.float32)
    k8, v8 = pack_kv(k_cache * magnitude), pack_kv(v_cache * magnitude)
    lens = torch.tensor([37, 70])
    tables = _tables(lens.tolist(), block_size, 12)
    q = torch.randn(2, heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = paged_decode_attention(q, k8, v8, tables, lens, scale, num_splits=2)
    want = paged_decode_attention_ref(
        q.float(), unpack_kv(k8, torch.float32), unpack_kv(v8, torch.float32), tables, lens, scale
    )
    tol = TOL.get(dtype, 1e-2)  # bfloat16: its own rounding of the output
    torch.testing.assert_close(got.float() / magnitude, want / magnitude, atol=tol, rtol=tol)


def _slot(table: torch.Tensor, position: int, block_size: int) -> int:
    return int(table[position // block_size]) * block_size + position % block_size
