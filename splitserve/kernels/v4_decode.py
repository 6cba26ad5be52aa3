"""DeepSeek-V4's decode attention (``engine/layers/v4_attention.py``) for one layer's decode
rows: each query (every head of one token, rotated by the caller) over one shared key per
token, which is also the value, with a learned sink per head in the softmax.

A row's keys are, in this order, (a) its window: the last ``window`` rows of its key table
(the window group's, whose first row is the block of the window's first position), and (b)
in a compressed layer its compressed entries, read through group 0's table: an entry of
``rate`` tokens lies in pieces of ``piece`` values in its tokens' slots, so value e of entry
i is in slot ``i * rate + e // piece``, column ``e % piece``. An HCA row takes every entry
whose window closed (``context_len // rate``); a CSA row those of its index list (the
lightning indexer's choice, ``kernels/v4_indexer.py``; -1, anywhere in it, is no entry).

Each program takes a tile of heads, one row and a split of SPLIT keys of the row's list
(window then entries), walking it in tiles of BLOCK_N keys, each loaded once and used as key
and value. The split count comes from the shapes alone (the window, the index list's width or
the entry table's), and every length is read on the device: nothing reaches the host, so a
decode step stays capturable in a CUDA graph, and a row's split boundaries do not move with
the batch. With one split a program folds its heads' sinks in itself; with more, each split
writes its partial output and log2-sum-exp, the first also the sinks as one more part (an
output of zeros), and ``decode_attention.merge_splits`` combines them.

The torch reference is the engine's own: ``engine/layers/v4_attention.py:
decode_reference``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.decode_attention import LOG2E, dot_precision, merge_splits


@triton.jit
def _online_update(q, k, valid, m, total, acc, scale_log2, PRECISION: tl.constexpr):
    """One tile of keys k [BLOCK_N, PAD_D] (also the values) into the running max, sum and
    output of the heads' queries q [BLOCK_H, PAD_D], in log2 units."""
    scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, 1))
    safe_m = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - safe_m[:, None])
    alpha = tl.exp2(m - safe_m)
    total = total * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, total, acc


@triton.jit
def _v4_decode_kernel(
    q_ptr, key_ptr, key_tables_ptr, key_lens_ptr, entry_ptr, entry_tables_ptr, lens_ptr,
    index_ptr, sinks_ptr, out_ptr, part_out_ptr, part_lse_ptr,
    scale_log2, window, max_entries, num_heads,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_key_table, stride_eb, stride_es,
    stride_entry_table, stride_index, stride_ot, stride_oh,
    DIM: tl.constexpr, PAD_D: tl.constexpr, BLOCK_H: tl.constexpr,
    KEY_BLOCK: tl.constexpr, ENTRY_BLOCK: tl.constexpr, RATE: tl.constexpr,
    PIECE: tl.constexpr, SELECTED: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    seq = tl.program_id(1)
    split = tl.program_id(2)
    d = tl.arange(0, PAD_D)
    n = tl.arange(0, BLOCK_N)
    head_ok = heads < num_heads
    d_ok = d < DIM
    q_rows = q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :]
    q = tl.load(q_rows, mask=head_ok[:, None] & d_ok[None, :], other=0.0)

    key_len = tl.load(key_lens_ptr + seq).to(tl.int32)
    near = tl.minimum(key_len, window)  # the window's keys: the table's last `near` rows
    closed = 0  # the entries whose windows closed
    far = 0  # the entries in the row's list
    if RATE > 0:
        closed = tl.load(lens_ptr + seq).to(tl.int32) // RATE
        far = max_entries if SELECTED else tl.minimum(closed, max_entries)
    start = split * SPLIT
    end = tl.minimum(start + SPLIT, near + far)

    m = tl.full([BLOCK_H], float("-inf"), tl.float32)
    total = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, PAD_D], tl.float32)
    for tile in range(start, tl.minimum(end, near), BLOCK_N):
        j = tile + n
        valid = j < tl.minimum(end, near)
        row = key_len - near + j
        block = tl.load(key_tables_ptr + seq * stride_key_table + row // KEY_BLOCK, mask=valid)
        at = block.to(tl.int64) * stride_kb + (row % KEY_BLOCK) * stride_ks
        k = tl.load(key_ptr + at[:, None] + d[None, :], mask=valid[:, None] & d_ok[None, :])
        m, total, acc = _online_update(q, k, valid, m, total, acc, scale_log2, PRECISION)
    if RATE > 0:
        for tile in range(tl.maximum(start, near), end, BLOCK_N):
            j = tile + n - near
            valid = j < end - near
            entry = j
            if SELECTED:
                entry = tl.load(index_ptr + seq * stride_index + j, mask=valid, other=-1)
                valid = valid & (entry >= 0) & (entry < closed)
            slot = entry[:, None] * RATE + d[None, :] // PIECE
            mask = valid[:, None] & d_ok[None, :]
            table = entry_tables_ptr + seq * stride_entry_table
            block = tl.load(table + slot // ENTRY_BLOCK, mask=mask, other=0).to(tl.int64)
            at = block * stride_eb + (slot % ENTRY_BLOCK) * stride_es + d[None, :] % PIECE
            k = tl.load(entry_ptr + at, mask=mask, other=0.0)
            m, total, acc = _online_update(q, k, valid, m, total, acc, scale_log2, PRECISION)

    sink = tl.load(sinks_ptr + heads, mask=head_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    if NUM_SPLITS == 1:
        top = tl.maximum(m, sink)
        alpha = tl.exp2(m - top)
        out = acc * alpha[:, None] / (total * alpha + tl.exp2(sink - top))[:, None]
        dst = out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_ok[:, None] & d_ok[None, :])
    else:
        safe = tl.where(total > 0, total, 1.0)
        part = (seq * num_heads + heads) * (NUM_SPLITS + 1) + split
        parts = part_out_ptr + part[:, None] * PAD_D + d[None, :]
        tl.store(parts, acc / safe[:, None], mask=head_ok[:, None])
        lse = tl.where(total > 0, m + tl.log2(safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=head_ok)
        if split == 0:
            sink_part = part + NUM_SPLITS
            zeros = tl.zeros([BLOCK_H, PAD_D], tl.float32)
            tl.store(parts + NUM_SPLITS * PAD_D, zeros, mask=head_ok[:, None])
            tl.store(part_lse_ptr + sink_part, sink, mask=head_ok)


NUM_STAGES = 2
"""Pipeline stages of the decode launch. Over caches whose strides are whole 16-byte
multiples Triton pipelines the key loads, and at its default of 3 stages a CSA layer's
program asked for 262,656 bytes of shared memory on the H100 and H200 (Triton 3.6; the limit
is 232,448) and failed to launch (benchmarks/kernels/v4_prefill.py's fresh caches; the
engine's caches, column views of wider rows, are not so aligned and took 131,072). At 2 the
aligned compile needs 131,200 (Triton 3.9 for sm_90a, tests/kernels/test_kernels_v4.py)."""


def default_tiles(heads: int, dim: int) -> tuple[int, int, int]:
    """(keys a tile, heads a program, warps) that v4_decode_attention launches with."""
    block_h = min(64, max(16, triton.next_power_of_2(heads)))
    return min(64, max(16, 16384 // dim)), block_h, 8 if block_h >= 64 else 4


def v4_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    key_tables: torch.Tensor,
    key_lens: torch.Tensor,
    sinks: torch.Tensor,
    window: int,
    entries: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None,
    index: torch.Tensor | None = None,
    split: int = 256,
    block_n: int | None = None,
    block_h: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """q [B, H, D] (rotated) over key_cache [blocks, key block size, D] (rows of the window
    group's tables key_tables [B, width], padded; key_lens [B] rows each, the last the
    query's own key), with sinks [H] (float32). entries: (entry_cache [blocks, entry block
    size, piece], group 0's tables [B, width], context_lens [B], rate) for a compressed layer;
    index [B, k] (int, -1 padding): a CSA layer's chosen entries, else every closed entry.
    split: keys per split (a multiple of block_n). -> [B, H, D].

    The default tiles: up to 64 heads a program (8 warps at 64 heads) and 16,384 key values
    a tile (32 keys of V4-Flash's 512): on the H200, 64 keys of 512 asked a compressed layer's
    program for 327,680 bytes of shared memory (the limit is 232,448), 32 keys for 196,608
    (Triton's sm_90a compile, tests/kernels/test_kernels_v4.py); not yet timed on V4's shapes."""
    batch, heads, dim = q.shape
    default_n, default_h, default_warps = default_tiles(heads, dim)
    block_n, block_h = block_n or default_n, block_h or default_h
    num_warps = num_warps or default_warps
    assert split % block_n == 0 and q.stride(2) == 1 and key_cache.stride(2) == 1
    assert key_tables.stride(1) == 1 and key_lens.is_contiguous() and sinks.is_contiguous()
    out = torch.empty_like(q)
    if batch == 0:
        return out
    entry_cache, entry_tables, lens, rate = entries or (key_cache, key_tables, key_lens, 0)
    max_entries, piece = 0, 1
    if rate:
        piece = entry_cache.shape[2]
        assert entry_cache.stride(2) == 1 and entry_tables.stride(1) == 1
        assert lens.is_contiguous() and (index is None or index.stride(1) == 1)
        held = entry_tables.shape[1] * entry_cache.shape[1] // rate
        max_entries = held if index is None else index.shape[1]
    splits = triton.cdiv(window + max_entries, split)
    pad_d = max(16, triton.next_power_of_2(dim))
    part_out = part_lse = out
    if splits > 1:
        part_out = torch.empty((batch, heads, splits + 1, pad_d), device=q.device)
        part_lse = torch.empty((batch, heads, splits + 1), device=q.device)
    selected = index if index is not None else key_lens
    _v4_decode_kernel[(triton.cdiv(heads, block_h), batch, splits)](
        q, key_cache, key_tables, key_lens, entry_cache, entry_tables, lens, selected, sinks,
        out, part_out, part_lse,
        dim**-0.5 * LOG2E, window, max_entries, heads,
        q.stride(0), q.stride(1), key_cache.stride(0), key_cache.stride(1),
        key_tables.stride(0), entry_cache.stride(0), entry_cache.stride(1),
        entry_tables.stride(0), selected.stride(0), out.stride(0), out.stride(1),
        DIM=dim, PAD_D=pad_d, BLOCK_H=block_h, KEY_BLOCK=key_cache.shape[1],
        ENTRY_BLOCK=entry_cache.shape[1], RATE=rate, PIECE=piece,
        SELECTED=index is not None, SPLIT=split, BLOCK_N=block_n, NUM_SPLITS=splits,
        PRECISION=dot_precision(q.dtype), num_warps=num_warps, num_stages=NUM_STAGES,
        **pdl.launch_kwargs(q),
    )  # fmt: skip
    if splits > 1:
        merge_splits(part_out, part_lse, out)
    return out
