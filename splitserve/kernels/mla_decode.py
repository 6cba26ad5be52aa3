"""Paged MLA decode attention in the absorbed form (DeepSeek-V2/V3, ``engine/layers/mla.py``).

Each sequence's query is ``latent_dim`` values per head (q_nope times W_UK, then the rotated
q_rope); the cache keeps one latent row per token, ``kv_lora_rank`` latent values then the
RoPE key, shared by every head (one KV head). Each program takes one (tile of BLOCK_H
heads, sequence, split of the context): it walks the split in tiles of BLOCK_N tokens gathered
through the block table, scores the heads against the latent and RoPE parts of each row, and
accumulates the latent part weighted by the online softmax. Each row is read once for all the
tile's heads (the head tiles of one sequence and split are launched side by side, the grid's
first axis); with more than one split each writes a partial output and its log-sum-exp and
``decode_attention.merge_splits`` combines them (flash-decoding). Nothing is read back to the
host, so a decode step stays capturable in a CUDA graph.

The torch reference is the engine's own: ``engine/layers/mla.py: mla_decode``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.decode_attention import (
    LOG2E,
    choose_num_splits,
    choose_tiles,
    dot_precision,
    merge_splits,
)
from splitserve.kernels.fp8_quant import FP8, KV_SCALE_VALUES


@triton.jit
def _mla_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_cb, stride_cs, stride_table, stride_ot, stride_oh, num_heads,
    LORA: tl.constexpr, ROPE: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, context)

    c = tl.arange(0, LORA)
    r = tl.arange(0, ROPE)
    head_ok = heads < num_heads
    q_row = q_ptr + seq * stride_qt + heads[:, None] * stride_qh
    q_lat = tl.load(q_row + c[None, :], mask=head_ok[:, None], other=0.0)
    q_rope = tl.load(q_row + LORA + r[None, :], mask=head_ok[:, None], other=0.0)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_H], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_H, LORA], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        row = cache_ptr + block.to(tl.int64) * stride_cb + (pos % BLOCK_SIZE) * stride_cs
        latent = tl.load(row[:, None] + c[None, :], mask=valid[:, None], other=0.0)
        rope = tl.load(row[:, None] + LORA + r[None, :], mask=valid[:, None], other=0.0)
        if FP8_KV:  # e4m3 rows, their float32 scale after them (engine/layers/fp8_kv.py)
            scale_ptr = (row + LORA + ROPE).to(tl.pointer_type(tl.float32))
            scale = tl.load(scale_ptr, mask=valid, other=0.0)[:, None]
            latent = (latent.to(tl.float32) * scale).to(q_lat.dtype)
            rope = (rope.to(tl.float32) * scale).to(q_lat.dtype)
        scores = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        scores += tl.dot(q_rope, tl.trans(rope), input_precision=PRECISION)
        scores = tl.where(valid[None, :], scores * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        m = m_new

    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + c[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None])
    else:
        part = (seq * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * LORA + c[None, :], out, mask=head_ok[:, None])
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_ok)


def mla_decode_attention(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
    num_splits: int | None = None,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """query [B, H, latent_dim] over latent_cache [num_blocks, block_size, 1, latent_dim]
    (an FP8 cache: latent_dim + 16, each row's scale after it, dequantized as it is loaded)
    (padded block_tables [B, max_blocks], context_lens [B]) -> [B, H, value_dim], the
    weighted first ``value_dim`` values of each row (the latent). value_dim and
    latent_dim - value_dim are powers of two of at least 16. block_n: context tokens per
    tile (default: 64 rows of a 512-value latent, 32 for 32 heads or fewer)."""
    batch, num_heads, latent_dim = query.shape
    rope = latent_dim - value_dim
    fp8 = latent_cache.dtype == FP8
    width = latent_dim + (KV_SCALE_VALUES if fp8 else 0)
    assert latent_cache.shape[2] == 1 and latent_cache.shape[3] == width
    assert value_dim == triton.next_power_of_2(value_dim) >= 16
    assert rope == triton.next_power_of_2(rope) >= 16
    assert query.stride(2) == 1 and latent_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert context_lens.is_contiguous()
    out = query.new_empty((batch, num_heads, value_dim))
    if batch == 0:
        return out
    block_size = latent_cache.shape[1]
    # Tiles measured on an H200 (benchmarks/kernels/mla_decode.py --sweep, DeepSeek-V3's 128
    # heads, batch 64, 4k context): 64 heads, 8 warps and 64 tokens a program took 331 µs,
    # the 16 heads and 4 warps before 881 µs; 128 heads or 128 tokens do not fit in shared
    # memory. Fewer heads (V2-Lite's 16) take one tile of them, and 32 tokens a tile: at 16
    # heads, batch 64, 4k / 16k / 32k context 127 / 415 / 807 µs against 161 / 587 / 1,153 with
    # 64 tokens (56-71% of the latent cache's bandwidth bound; the same run, 1k: 135 / 135).
    # Fewer heads also took twice the splits (about four programs an SM) and two pipeline
    # stages: 118 µs at 4k against 148 (--sweep 4096 --sweep-query-heads 16, H200, 62% of its
    # measured 4.10 TB/s copy bandwidth).
    block_h = block_h or min(64, max(16, triton.next_power_of_2(num_heads)))
    few_heads = block_h < 64
    tokens = 32 if few_heads else 64
    num_warps = num_warps or (4 if few_heads else 8)
    num_stages = num_stages or (2 if few_heads else None)
    head_tiles = triton.cdiv(num_heads, block_h)
    _, min_tokens = choose_tiles(batch * head_tiles, query.device, query.element_size())
    splits = num_splits or choose_num_splits(
        batch * head_tiles, block_tables.shape[1] * block_size, query.device, min_tokens,
        per_sm=4 if few_heads else 2,
    )  # fmt: skip
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, value_dim), device=query.device)
        part_lse = torch.empty((batch, num_heads, splits), device=query.device)
    _mla_decode_kernel[(head_tiles, batch, splits)](
        query, latent_cache, block_tables, context_lens, out, part_out, part_lse,
        scale * LOG2E,
        query.stride(0), query.stride(1), latent_cache.stride(0), latent_cache.stride(1),
        block_tables.stride(0), out.stride(0), out.stride(1), num_heads,
        LORA=value_dim, ROPE=rope, BLOCK_H=block_h, BLOCK_SIZE=block_size,
        BLOCK_N=block_n or min(tokens, max(16, 32768 // value_dim)), NUM_SPLITS=splits,
        PRECISION=dot_precision(query.dtype),
        FP8_KV=fp8, num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}),
        **pdl.launch_kwargs(query),
    )  # fmt: skip
    if splits > 1:
        merge_splits(part_out, part_lse, out)
    return out
