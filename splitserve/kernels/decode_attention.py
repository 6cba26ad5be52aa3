"""Paged decode attention: one query token per sequence over its paged KV cache.

Each program takes one (sequence, KV head, split): the query heads of that KV group are the rows
of one tile (GQA without repeating K/V), and the split's range of context tokens is walked in
tiles of BLOCK_N tokens gathered through the block table (any block size). With more than one
split (flash-decoding) each split writes a partial output and its log-sum-exp, and a second
kernel merges them.

``paged_decode_attention_qkv`` takes the step's q|k|v projection instead of a rotated q: each
program rotates its query heads itself, and the program whose split holds the newest token
rotates that token's key, writes it and its value to the cache and only then walks its tiles.
That is the rotary + K/V write launch of a decode step folded into the attention launch.

An FP8 cache (float8_e4m3fn rows of ``head_dim + 16``: the values, then the float32 scale's
bytes and padding; ``engine/layers/fp8_kv.py``) enters the dots as e4m3 values widened to the
query's dtype (exact), each key's scale multiplying its score and each value's scale its
softmax weight; the fused write does not quantize, so FP8 steps take the unfused launch.
``load_kv`` (the prefill kernel's) dequantizes whole rows as it loads them instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.dispatch import num_sms
from splitserve.kernels.fp8_quant import FP8, KV_SCALE_VALUES
from splitserve.kernels.rotary import cos_sin, rotate_half

LOG2E = 1.4426950408889634


@triton.jit
def load_kv(
    cache_ptr, off, d, mask, valid,
    HEAD_DIM: tl.constexpr, FP8_ROWS: tl.constexpr, dtype: tl.constexpr,
):  # fmt: skip
    """Rows [off + d] of a K or V cache; FP8 rows times the float32 scale stored after them."""
    rows = tl.load(cache_ptr + off[:, None] + d[None, :], mask=mask, other=0.0)
    if FP8_ROWS:  # a masked row: 0 x 0, never NaN
        rows = (rows.to(tl.float32) * row_scale(cache_ptr, off, valid, HEAD_DIM)[:, None]).to(dtype)
    return rows


@triton.jit
def row_scale(cache_ptr, off, valid, HEAD_DIM: tl.constexpr):
    """The float32 scales stored after FP8 rows [off] (0 for rows not valid)."""
    return tl.load(
        (cache_ptr + off + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=valid, other=0.0
    )


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    pos_ptr, cos_ptr, sin_ptr, slot_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, stride_ot, stride_oh, stride_cos, num_heads,
    GROUP: tl.constexpr, PAD_G: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr, FROM_QKV: tl.constexpr, PDL: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(lens_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, context)

    g = tl.arange(0, PAD_G)
    d = tl.arange(0, PAD_D)
    heads = kv_head * GROUP + g
    row_mask = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q_off = seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    if FROM_QKV:
        # q_ptr is the q|k|v row of each sequence; cos/sin rows are [HEAD_DIM], halves equal.
        dtype = k_cache_ptr.dtype.element_ty
        c, s = cos_sin(pos_ptr, cos_ptr, sin_ptr, seq, stride_cos, dtype, HEAD_DIM, PAD_D)
        row = q_ptr + seq * stride_qt
        q = rotate_half(row + heads[:, None] * HEAD_DIM, d[None, :], c, s, row_mask,
                        HEAD_DIM // 2)  # fmt: skip
        slot = tl.load(slot_ptr + seq).to(tl.int64)
        if (context - 1 >= start) & (context - 1 < end) & (slot >= 0):
            k_src = row + (num_heads + kv_head) * HEAD_DIM
            dd = d[None, :]
            dmask = dd < HEAD_DIM
            k_new = rotate_half(k_src, dd, c, s, dmask, HEAD_DIM // 2)
            v_new = tl.load(k_src + tl.num_programs(1) * HEAD_DIM + dd, mask=dmask)
            at = (slot // BLOCK_SIZE) * stride_kb + (slot % BLOCK_SIZE) * stride_ks
            tl.store(k_cache_ptr + at + kv_head * stride_kh + dd, k_new, mask=dmask)
            at = (slot // BLOCK_SIZE) * stride_vb + (slot % BLOCK_SIZE) * stride_vs
            tl.store(v_cache_ptr + at + kv_head * stride_vh + dd, v_new, mask=dmask)
            # The tiles below read the new token back; the barrier makes every thread's
            # store visible to the whole program first.
            tl.debug_barrier()
    else:
        q = tl.load(q_ptr + q_off, mask=row_mask, other=0.0)

    # Over an FP8 cache in half precision the dots run in float16: e4m3 pairs widen to it in
    # one instruction (to bfloat16 they took three), and the query goes there scaled by a
    # power of two that puts its largest value at 2^13-2^14 (exact, far inside float16's
    # range); that power goes back into each key's scale.
    HALF_DOTS: tl.constexpr = FP8_KV and q.dtype != tl.float32
    q_unit = 1.0
    if HALF_DOTS:
        q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), 1), 0)
        exponent = tl.maximum(((q_max.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 13, 1)
        q_unit = (exponent << 23).to(tl.float32, bitcast=True)
        q = q.to(tl.float32) * ((254 - exponent) << 23).to(tl.float32, bitcast=True)
        q = q.to(tl.float16)

    m = tl.full([PAD_G], float("-inf"), tl.float32)
    l = tl.zeros([PAD_G], tl.float32)  # noqa: E741
    acc = tl.zeros([PAD_G, PAD_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for tile in range(start, end, BLOCK_N):
        pos = tile + n
        valid = pos < end
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)
        kv_mask = valid[:, None] & (d < HEAD_DIM)[None, :]
        k_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        v_off = block * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        k = tl.load(k_cache_ptr + k_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:
            # e4m3 values are exact in float16 and float32: the dots take them as they are and
            # each key's scale multiplies its score, each value's scale its weight (one
            # multiply a token, not one an element).
            k_scale = row_scale(k_cache_ptr, k_off, valid, HEAD_DIM) * (scale_log2 * q_unit)
            scores = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION)
            scores *= k_scale[None, :]
        else:
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        v = tl.load(v_cache_ptr + v_off[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if HALF_DOTS:
            # each weight times its value's scale over the tile's largest scale (at most 1:
            # the product of a weight and a small scale would fall below float16's normal
            # range), the tile's sum times that largest scale
            v_scale = row_scale(v_cache_ptr, v_off, valid, HEAD_DIM)
            v_max = tl.max(v_scale, 0)
            v_max = tl.where(v_max > 0, v_max, 1.0)
            weights = (p * (v_scale / v_max)[None, :]).to(tl.float16)
            part = tl.dot(weights, v.to(tl.float16), input_precision=PRECISION) * v_max
        elif FP8_KV:
            weights = p * row_scale(v_cache_ptr, v_off, valid, HEAD_DIM)[None, :]
            part = tl.dot(weights, v.to(tl.float32), input_precision=PRECISION)
        else:
            part = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc = acc * alpha[:, None] + part
        m = m_new

    safe_l = tl.where(l > 0, l, 1.0)
    out = acc / safe_l[:, None]
    if NUM_SPLITS == 1:
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)
    else:
        part = (seq * GROUP * tl.num_programs(1) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + part[:, None] * PAD_D + d[None, :], out, mask=row_mask)
        lse = tl.where(l > 0, m + tl.log2(safe_l), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=g < GROUP)


@triton.jit
def _merge_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    PAD_S: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, PAD_S)
    d = tl.arange(0, PAD_D)
    base = (seq * tl.num_programs(1) + head) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + s, mask=s < NUM_SPLITS, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))
    parts = tl.load(
        part_out_ptr + (base + s)[:, None] * PAD_D + d[None, :],
        mask=(s < NUM_SPLITS)[:, None] & (d < HEAD_DIM)[None, :],
        other=0.0,
    )
    out = tl.sum(parts * weight[:, None], 0) / tl.sum(weight, 0)
    dst = out_ptr + seq * stride_ot + head * stride_oh + d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def _num_sms(device: torch.device) -> int:
    return num_sms(device) or 1


def choose_num_splits(
    programs: int, max_context: int, device: torch.device, min_tokens: int = 256, per_sm: int = 2
) -> int:
    """Enough splits to give every SM about ``per_sm`` programs, each split >= min_tokens; a
    power of two (rounded down), so that a server compiles six variants at most
    (engine/warm_up.py)."""
    want = triton.cdiv(per_sm * _num_sms(device), max(programs, 1))
    splits = max(1, min(want, triton.cdiv(max_context, min_tokens), 32))
    return 1 << (splits.bit_length() - 1)


def choose_tiles(programs: int, device: torch.device, element_size: int) -> tuple[int, int]:
    """(tile length, shortest split) for a launch of ``programs`` (sequence, KV head) pairs.

    With fewer pairs than SMs (small batches) 32-token tiles and splits down to 64 tokens
    spread one sequence over the GPU; measured on an H200 at batch 1 with a 1k context
    (benchmarks/gpu/fastpath.py): Llama-3-8B 6.2 us per layer against 6.5 with 128-token
    tiles, SmolLM2-135M 4.6 against 5.0. Otherwise 128-token tiles (64 for float32 caches)."""
    if programs < _num_sms(device):
        return 32, 64
    return (128 if element_size <= 2 else 64), 256


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks]
    (padded); context_lens [B] -> [B, H, D]. Written into ``out`` when given."""
    out = torch.empty_like(q) if out is None else out
    assert q.stride(2) == 1
    _launch(q, q.shape[1], q.stride(0), q.stride(1), None, k_cache, v_cache, block_tables,
            context_lens, scale, out, num_splits, block_n, num_warps)  # fmt: skip
    return out


def paged_decode_attention_qkv(
    qkv: torch.Tensor,
    num_heads: int,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    num_splits: int | None = None,
    block_n: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """Rotary, the K/V write and decode attention in one launch. qkv: [B, (H + 2 * Hkv) * D]
    (q | k | v of each sequence's newest token, at ``positions``, going to ``slot_mapping``;
    negative slots are padding and not written); cos/sin: [max_positions, D] float32 tables;
    context_lens count the newest token. -> [B, H, D], as rotary_kv_write followed by
    paged_decode_attention."""
    head_dim = k_cache.shape[3]
    assert qkv.shape[1] == (num_heads + 2 * k_cache.shape[2]) * head_dim and qkv.stride(1) == 1
    assert k_cache.dtype == qkv.dtype and slot_mapping.is_contiguous() and positions.is_contiguous()
    assert cos.stride(1) == 1 and sin.stride() == cos.stride()
    if out is None:
        out = torch.empty((qkv.shape[0], num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    rotary = (positions, cos, sin, slot_mapping)
    _launch(qkv, num_heads, qkv.stride(0), head_dim, rotary, k_cache, v_cache, block_tables,
            context_lens, scale, out, num_splits, block_n, num_warps)  # fmt: skip
    return out


def _launch(
    q: torch.Tensor,
    num_heads: int,
    stride_qt: int,
    stride_qh: int,
    rotary: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int | None,
    block_n: int | None,
    num_warps: int,
) -> None:
    batch = q.shape[0]
    _, block_size, num_kv_heads, width = k_cache.shape
    fp8 = k_cache.dtype == FP8
    head_dim = width - KV_SCALE_VALUES if fp8 else width
    assert not (fp8 and rotary), "the fused K/V write does not quantize: write an FP8 cache first"
    if batch == 0:
        return
    assert out.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert context_lens.is_contiguous()
    group = num_heads // num_kv_heads
    tile, min_tokens = choose_tiles(batch * num_kv_heads, q.device, q.element_size())
    splits = num_splits or choose_num_splits(
        batch * num_kv_heads, block_tables.shape[1] * block_size, q.device, min_tokens
    )
    block_n = block_n or tile
    pad_d = max(16, triton.next_power_of_2(head_dim))
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty((batch, num_heads, splits, pad_d), device=q.device)
        part_lse = torch.empty((batch, num_heads, splits), device=q.device)
    positions, cos, sin, slots = rotary or (context_lens, out, out, context_lens)
    _decode_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse,
        positions, cos, sin, slots,
        scale * LOG2E,
        stride_qt, stride_qh, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1), cos.stride(0), num_heads,
        GROUP=group, PAD_G=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, PAD_D=pad_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        NUM_SPLITS=splits, PRECISION=dot_precision(q.dtype), FROM_QKV=rotary is not None,
        FP8_KV=fp8, num_warps=num_warps, **pdl.launch_kwargs(q),
    )  # fmt: skip
    if splits > 1:
        merge_splits(part_out, part_lse, out)


def merge_splits(part_out: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """Flash-decoding's second launch: each head's split outputs part_out [B, H, S, PAD_D]
    (float32) weighted by their log2-sum-exp part_lse [B, H, S] into out [B, H, D]."""
    batch, num_heads, splits, pad_d = part_out.shape
    _merge_kernel[(batch, num_heads)](
        part_out, part_lse, out, out.stride(0), out.stride(1),
        HEAD_DIM=out.shape[2], PAD_D=pad_d, NUM_SPLITS=splits,
        PAD_S=triton.next_power_of_2(splits), **pdl.launch_kwargs(out),
    )  # fmt: skip


def dot_precision(dtype: torch.dtype) -> str:
    """Full-precision dots for float32 (the default would be TF32 on NVIDIA GPUs)."""
    return "ieee" if dtype == torch.float32 else "tf32"


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch reference, in float32: a masked softmax over each sequence's gathered context."""
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    keys = k_cache[block_tables].flatten(1, 2).float()  # [B, L, Hkv, D]
    values = v_cache[block_tables].flatten(1, 2).float()
    keys = keys.repeat_interleave(num_heads // num_kv_heads, dim=2)
    values = values.repeat_interleave(num_heads // num_kv_heads, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.float(), keys) * scale
    length = keys.shape[1]
    mask = torch.arange(length, device=q.device)[None, :] < context_lens[:, None]
    scores = scores.masked_fill(~mask[:, None, :], float("-inf"))
    out = torch.einsum("bhl,blhd->bhd", scores.softmax(-1), values)
    return out.to(q.dtype)
