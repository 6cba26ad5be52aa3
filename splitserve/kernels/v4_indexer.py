"""DeepSeek-V4's lightning indexer for decode rows (``engine/layers/lightning_indexer.py``):
each row's score of every compressed entry of its context, then the ``topk`` best as the
index list that ``kernels/v4_decode.py`` takes.

Scores: each program takes one row and a tile of BLOCK_N entries, gathers their index keys
(values ``offset ..`` of each entry, through group 0's table as the attention kernel reads
entries), scores every index head against them in one dot, and writes
sum_h w_h relu(q_h . k) / sqrt(dim), -inf for the entries not closed yet. The grid is fixed by
the table's width, and each row's length is read on the device.

Selection (torch, no host read, fixed shapes: capturable in a CUDA graph): the entries
scoring above the k-th best, then those equal to it from the lowest index up until k are
chosen, so ties go to the earlier entry, whatever ``torch.topk`` does on the device; the list
holds the chosen entries in increasing order, then -1. The engine's torch path picks by
``torch.topk`` alone, so the two agree except where the k-th best score is tied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.decode_attention import dot_precision


@triton.jit
def _index_scores_kernel(
    q_ptr, w_ptr, entry_ptr, tables_ptr, lens_ptr, out_ptr, scale, max_entries,
    stride_qt, stride_qh, stride_wt, stride_eb, stride_es, stride_table, stride_ot,
    HEADS: tl.constexpr, PAD_H: tl.constexpr, DIM: tl.constexpr, PAD_D: tl.constexpr,
    OFFSET: tl.constexpr, ENTRY_BLOCK: tl.constexpr, RATE: tl.constexpr, PIECE: tl.constexpr,
    BLOCK_N: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    seq = tl.program_id(0)
    j = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    h = tl.arange(0, PAD_H)
    d = tl.arange(0, PAD_D)
    q_mask = (h < HEADS)[:, None] & (d < DIM)[None, :]
    q = tl.load(q_ptr + seq * stride_qt + h[:, None] * stride_qh + d[None, :], mask=q_mask)
    w = tl.load(w_ptr + seq * stride_wt + h, mask=h < HEADS, other=0.0).to(tl.float32)
    valid = j < tl.load(lens_ptr + seq).to(tl.int32) // RATE
    mask = valid[:, None] & (d < DIM)[None, :]
    slot = j[:, None] * RATE + (OFFSET + d[None, :]) // PIECE
    block = tl.load(tables_ptr + seq * stride_table + slot // ENTRY_BLOCK, mask=mask, other=0)
    at = block.to(tl.int64) * stride_eb + (slot % ENTRY_BLOCK) * stride_es
    k = tl.load(entry_ptr + at + (OFFSET + d[None, :]) % PIECE, mask=mask, other=0.0)
    scores = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0) * scale
    score = tl.sum(scores * w[:, None], 0)
    dst = out_ptr + seq * stride_ot + j
    tl.store(dst, tl.where(valid, score, float("-inf")), mask=j < max_entries)


def index_scores(
    q: torch.Tensor,
    weights: torch.Tensor,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int],
    offset: int,
    block_n: int = 64,
) -> torch.Tensor:
    """q [B, heads, dim] (rotated) and head weights [B, heads] against the index keys (values
    offset .. offset + dim of each entry) of entries: (entry_cache [blocks, block size,
    piece], group 0's tables [B, width], context_lens [B], rate). -> [B, width * block size
    // rate] float32, -inf past each row's closed entries."""
    batch, heads, dim = q.shape
    entry_cache, tables, lens, rate = entries
    assert q.stride(2) == 1 and entry_cache.stride(2) == 1 and tables.stride(1) == 1
    assert lens.is_contiguous() and weights.stride(1) == 1
    max_entries = tables.shape[1] * entry_cache.shape[1] // rate
    out = torch.empty((batch, max_entries), dtype=torch.float32, device=q.device)
    if batch == 0 or max_entries == 0:
        return out
    _index_scores_kernel[(batch, triton.cdiv(max_entries, block_n))](
        q, weights, entry_cache, tables, lens, out, dim**-0.5, max_entries,
        q.stride(0), q.stride(1), weights.stride(0), entry_cache.stride(0),
        entry_cache.stride(1), tables.stride(0), out.stride(0),
        HEADS=heads, PAD_H=max(16, triton.next_power_of_2(heads)), DIM=dim,
        PAD_D=max(16, triton.next_power_of_2(dim)), OFFSET=offset,
        ENTRY_BLOCK=entry_cache.shape[1], RATE=rate, PIECE=entry_cache.shape[2],
        BLOCK_N=block_n, PRECISION=dot_precision(q.dtype), **pdl.launch_kwargs(q),
    )  # fmt: skip
    return out


def select_topk(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Scores [B, n] (-inf: not visible) -> [B, min(topk, n)] int64: each row's best topk
    visible entries in increasing order, ties at the k-th score to the lower index, -1 after
    them where fewer are visible."""
    k = min(topk, scores.shape[1])
    if k == 0:
        return torch.empty((scores.shape[0], 0), dtype=torch.long, device=scores.device)
    kth = scores.topk(k, dim=1).values[:, -1:]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(dim=1, keepdim=True)
    chosen = (above | (tied & (tied.cumsum(dim=1) <= room))) & (scores > -torch.inf)
    place = torch.where(chosen, chosen.cumsum(dim=1) - 1, k)
    columns = torch.arange(scores.shape[1], device=scores.device).expand_as(scores)
    index = torch.full((scores.shape[0], k + 1), -1, dtype=torch.long, device=scores.device)
    return index.scatter_(1, place, columns)[:, :k]
