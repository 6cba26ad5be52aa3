"""Causal prefill attention over a paged prefix plus the new tokens (varlen batch).

Sequence s has ``q_lens[s]`` new query tokens at rows [q_starts[s], q_starts[s] + q_lens[s]) of
q; they sit at positions [context_lens[s] - q_lens[s], context_lens[s]) and attend to every
cached token of the sequence up to their own position. K/V are read from the paged cache only,
so the step's own K/V must be written there first (an FP8 cache's rows are dequantized as
they are loaded, ``decode_attention.load_kv``). Each program takes one tile of BLOCK_M query
rows of one head.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.decode_attention import LOG2E, dot_precision, load_kv
from splitserve.kernels.fp8_quant import FP8


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, q_starts_ptr, q_lens_ptr, lens_ptr, out_ptr,
    scale_log2,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_table, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, FP8_KV: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_len = tl.load(q_lens_ptr + seq).to(tl.int32)
    first_row = tl.program_id(2) * BLOCK_M
    if first_row >= q_len:
        return
    context = tl.load(lens_ptr + seq).to(tl.int32)
    q_start = tl.load(q_starts_ptr + seq).to(tl.int64)
    kv_head = head // GROUP

    rows = first_row + tl.arange(0, BLOCK_M)
    positions = context - q_len + rows
    d = tl.arange(0, PAD_D)
    d_mask = (d < HEAD_DIM)[None, :]
    row_mask = (rows < q_len)[:, None] & d_mask
    q_rows = (q_start + rows)[:, None] * stride_qt + head * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_rows, mask=row_mask, other=0.0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)  # noqa: E741
    acc = tl.zeros([BLOCK_M, PAD_D], tl.float32)
    n = tl.arange(0, BLOCK_N)
    kv_end = tl.minimum(context, context - q_len + first_row + BLOCK_M)
    for tile in range(0, kv_end, BLOCK_N):
        pos = tile + n
        valid = pos < kv_end
        block = tl.load(tables_ptr + seq * stride_table + pos // BLOCK_SIZE, mask=valid, other=0)
        block = block.to(tl.int64)
        kv_mask = valid[:, None] & d_mask
        k_off = block * stride_kb + (pos % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        k = load_kv(k_cache_ptr, k_off, d, kv_mask, valid, HEAD_DIM, FP8_KV, q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
        causal = (pos[None, :] <= positions[:, None]) & valid[None, :]
        scores = tl.where(causal, scores, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, 1)  # noqa: E741
        v_off = block * stride_vb + (pos % BLOCK_SIZE) * stride_vs + kv_head * stride_vh
        v = load_kv(v_cache_ptr, v_off, d, kv_mask, valid, HEAD_DIM, FP8_KV, q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m = m_new

    out = acc / l[:, None]
    dst = out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    max_q_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; block_tables [S, max_blocks] (padded); q_starts, q_lens, context_lens [S];
    max_q_len >= every q_lens[s]. Fills the rows of each sequence in ``out`` ([T, H, D]) and
    leaves other rows untouched."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, block_size, num_kv_heads, _ = k_cache.shape
    out = torch.empty_like(q) if out is None else out
    num_seqs = q_lens.shape[0]
    if num_seqs == 0 or max_q_len == 0:
        return out
    assert q.stride(2) == 1 and out.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1 and block_tables.stride(1) == 1
    assert q_starts.is_contiguous() and q_lens.is_contiguous() and context_lens.is_contiguous()
    wide = q.element_size() > 2
    block_m = block_m or (32 if wide else 64)
    block_n = block_n or (32 if wide else 64)
    grid = (num_seqs, num_heads, triton.cdiv(max_q_len, block_m))
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, q_starts, q_lens, context_lens, out,
        scale * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        PAD_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=dot_precision(q.dtype),
        FP8_KV=k_cache.dtype == FP8,
    )  # fmt: skip
    return out


def paged_prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    q_starts: torch.Tensor,
    q_lens: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The torch reference, in float32, one sequence at a time; rows of no sequence are zero."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for s in range(q_lens.shape[0]):
        start, length, context = int(q_starts[s]), int(q_lens[s]), int(context_lens[s])
        keys = k_cache[block_tables[s]].flatten(0, 1)[:context].float()
        values = v_cache[block_tables[s]].flatten(0, 1)[:context].float()
        keys = keys.repeat_interleave(group, dim=1)
        values = values.repeat_interleave(group, dim=1)
        queries = q[start : start + length].float()
        scores = torch.einsum("thd,lhd->htl", queries, keys) * scale
        positions = torch.arange(length, device=q.device) + context - length
        allowed = torch.arange(context, device=q.device)[None, :] <= positions[:, None]
        scores = scores.masked_fill(~allowed, float("-inf"))
        attended = torch.einsum("htl,lhd->thd", scores.softmax(-1), values)
        out[start : start + length] = attended.to(q.dtype)
    return out
