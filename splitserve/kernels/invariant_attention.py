"""The attention kernel of deterministic mode: decode rows, verify rows and prompt chunks all
run one kernel over the paged cache, so a query row's softmax sums run in one order whether
it is a decode token or a prompt token, alone or batched, its keys cached or fresh.

A program takes one tile of ``BLOCK_M`` query rows for one KV head: up to ``BLOCK_M // group``
consecutive positions of one sequence times the ``group`` query heads of that KV head (a
decode row is a tile of one position, the rest masked). It reads every key from the paged
cache (the step's K/V are written first), in ``BLOCK_N``-key tiles at absolute key positions,
grouped into splits of ``KV_SPLIT`` keys: each split's softmax state (max, sum, weighted
values) is built tile by tile, and the splits' states are merged in order. Every row runs the
same ``tl.dot`` shapes, the same per-row reductions and the same merges; what differs between
rows of one tile is which keys they see, and the keys a row does not see change nothing:

- a key tile past a row's position has every score at -inf: its max does not move, its
  rescale is 1 (``tl.where``, not ``exp2(0)``), its weights are 0;
- a split past a row's position leaves an empty state, which the merge skips (``tl.where``).

So a row gets the same bits in a tile of many positions as in a tile of its own, however far
the other rows reach. The query row's position in the tile does not matter either: an MMA's
output row depends only on its own input row. Integer arguments that vary by step are not
specialised (``do_not_specialize``), so every step runs one compiled variant.

A step with few decode rows (a batch-1 decode: one program per KV head) runs their splits as
programs of their own (``_decode_split_kernel``, the same ``_split_state``), their states
stored in float32 and merged in split order by ``_decode_merge_kernel`` with the same
``_merge``, whose FMAs are explicit so that no kernel contracts them otherwise: the bits of
the in-program merge (``benchmarks/kernels/invariant_compile.py`` compiles both).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.decode_attention import dot_precision

BLOCK_M = 64
"""Query rows (positions x query heads of one KV head) per program."""
BLOCK_N = 64
"""Keys per tile."""
KV_SPLIT = 512
"""Keys per split: a constant, never derived from the batch or the context."""
NUM_WARPS = 8
TARGET_PROGRAMS = 128
"""Below this many (decode row, KV head) programs a step's decode rows run their splits as
programs of their own (about one program per multiprocessor of an H100/H200)."""
LOG2E = 1.4426950408889634


@triton.jit
def _merge(m_a, sum_a, acc_a, m_b, sum_b, acc_b):
    """Two softmax states (max, sum, weighted values) as one; an empty state (max -inf) is
    skipped exactly. Explicit FMAs: the same operations whichever kernel merges (the split
    merge kernel's layout is not the attention kernel's)."""
    m = tl.maximum(m_a, m_b)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    scale_a = tl.exp2(m_a - m_safe)
    scale_b = tl.exp2(m_b - m_safe)
    sum_both = tl.fma(sum_a, scale_a, sum_b * scale_b)
    acc_both = tl.fma(acc_a, scale_a[:, None], acc_b * scale_b[:, None])
    empty_a, empty_b = m_a == float("-inf"), m_b == float("-inf")
    total = tl.where(empty_b, sum_a, tl.where(empty_a, sum_b, sum_both))
    acc = tl.where(empty_b[:, None], acc_a, tl.where(empty_a[:, None], acc_b, acc_both))
    return m, total, acc


@triton.jit
def _split_state(
    q, k_ptr, v_ptr, table, kv_head, position, split, end, dims, dim_ok,
    stride_kb, stride_ks, stride_kh, scale,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAD_D: tl.constexpr,
    KV_SPLIT: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    """The softmax state of the tile's rows over the keys of one split, [split, split +
    KV_SPLIT) below end, tile by tile."""
    m_s = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    sum_s = tl.zeros((BLOCK_M,), tl.float32)
    acc_s = tl.zeros((BLOCK_M, PAD_D), tl.float32)
    for start in range(split, tl.minimum(split + KV_SPLIT, end), BLOCK_N):
        keys = start + tl.arange(0, BLOCK_N)
        key_ok = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=key_ok, other=0)
        kv_at = block * stride_kb + (keys % BLOCK_SIZE) * stride_ks + kv_head * stride_kh
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_ptr + kv_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        s = tl.where(keys[None, :] <= position[:, None], s, float("-inf"))
        m_new = tl.maximum(m_s, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.where(m_new > m_s, tl.exp2(m_s - m_safe), 1.0)
        p = tl.exp2(s - m_safe[:, None])
        sum_s = sum_s * alpha + tl.sum(p, 1)
        v = tl.load(v_ptr + kv_at[:, None] + dims[None, :], mask=kv_mask, other=0.0)
        pv = tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        acc_s = acc_s * alpha[:, None] + pv
        m_s = m_new
    return m_s, sum_s, acc_s


@triton.jit(do_not_specialize=["num_decode", "dec_stride", "pre_stride"])
def _invariant_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr,
    dec_tables, dec_lens, dec_stride, num_decode,
    tile_rows, tile_firsts, tile_counts, tile_seqs, pre_tables, pre_stride,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, scale,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    tile = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    # The tile: its first row in q, its first position, how many positions, its block table.
    if tile < num_decode:
        row0 = tile
        first = tl.load(dec_lens + tile).to(tl.int64) - 1
        count = tl.full((), 1, tl.int64)
        table = dec_tables + tile * dec_stride
    else:
        t = tile - num_decode
        row0 = tl.load(tile_rows + t).to(tl.int64)
        first = tl.load(tile_firsts + t).to(tl.int64)
        count = tl.load(tile_counts + t).to(tl.int64)
        table = pre_tables + tl.load(tile_seqs + t).to(tl.int64) * pre_stride
    r = tl.arange(0, BLOCK_M)
    offset = r // GROUP
    row_ok = offset < count
    position = first + offset
    heads = kv_head * GROUP + r % GROUP
    dims = tl.arange(0, PAD_D)
    dim_ok = dims < HEAD_DIM
    q_at = (row0 + offset)[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    end = first + count  # keys [0, end) cover every row of the tile
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, PAD_D), tl.float32)
    for split in range(0, end, KV_SPLIT):
        m_s, sum_s, acc_s = _split_state(
            q, k_ptr, v_ptr, table, kv_head, position, split, end, dims, dim_ok,
            stride_kb, stride_ks, stride_kh, scale,
            BLOCK_SIZE, BLOCK_M, BLOCK_N, PAD_D, KV_SPLIT, PRECISION,
        )  # fmt: skip
        m, total, acc = _merge(m, total, acc, m_s, sum_s, acc_s)
    out = acc / total[:, None]
    out_at = (row0 + offset)[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(
        out_ptr + out_at,
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None] & dim_ok[None, :],
    )


@triton.jit(do_not_specialize=["num_decode", "dec_stride"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, part_m, part_sum, part_acc, dec_tables, dec_lens, dec_stride,
    num_decode, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, scale,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    KV_SPLIT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One split of one decode row's keys for one KV head, its state to the partials
    ([splits, rows, heads] and [splits, rows, heads, PAD_D], float32)."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2).to(tl.int64) * KV_SPLIT
    end = tl.load(dec_lens + row).to(tl.int64)
    if split >= end:
        return
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP  # a one-position tile, as the attention kernel lays a decode row out
    position = end - 1 + r // GROUP
    heads = kv_head * GROUP + r % GROUP
    dims = tl.arange(0, PAD_D)
    dim_ok = dims < HEAD_DIM
    q_at = row * stride_qt + heads[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_at, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    m_s, sum_s, acc_s = _split_state(
        q, k_ptr, v_ptr, dec_tables + row * dec_stride, kv_head, position, split, end, dims,
        dim_ok, stride_kb, stride_ks, stride_kh, scale,
        BLOCK_SIZE, BLOCK_M, BLOCK_N, PAD_D, KV_SPLIT, PRECISION,
    )  # fmt: skip
    at = ((split // KV_SPLIT) * num_decode + row) * HEADS + heads
    tl.store(part_m + at, m_s, mask=row_ok)
    tl.store(part_sum + at, sum_s, mask=row_ok)
    tl.store(part_acc + at[:, None] * PAD_D + dims[None, :], acc_s, mask=row_ok[:, None])


@triton.jit(do_not_specialize=["num_decode"])
def _decode_merge_kernel(
    part_m, part_sum, part_acc, out_ptr, dec_lens, num_decode, stride_ot, stride_oh,
    HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
    BLOCK_M: tl.constexpr, KV_SPLIT: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """A decode row's split states merged in split order with ``_merge``, as the attention
    kernel merges them in a program."""
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    end = tl.load(dec_lens + row).to(tl.int64)
    r = tl.arange(0, BLOCK_M)
    row_ok = r < GROUP
    heads = kv_head * GROUP + r % GROUP
    dims = tl.arange(0, PAD_D)
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    total = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, PAD_D), tl.float32)
    for split in range(0, tl.cdiv(end, KV_SPLIT)):
        at = (split * num_decode + row) * HEADS + heads
        m_s = tl.load(part_m + at, mask=row_ok, other=float("-inf"))
        sum_s = tl.load(part_sum + at, mask=row_ok, other=0.0)
        acc_s = tl.load(part_acc + at[:, None] * PAD_D + dims[None, :], mask=row_ok[:, None])
        m, total, acc = _merge(m, total, acc, m_s, sum_s, acc_s)
    out = acc / tl.where(row_ok, total, 1.0)[:, None]  # the padding rows: no 0 / 0
    out_at = row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    ok = row_ok[:, None] & (dims < HEAD_DIM)[None, :]
    tl.store(out_ptr + out_at, out.to(out_ptr.dtype.element_ty), mask=ok)


def prefill_tiles(
    segments: list[tuple[int, int, int]], group: int, device: torch.device
) -> tuple[torch.Tensor, ...]:
    """The tiles of prompt chunks (first row in q, new tokens, context length), a chunk's
    ``BLOCK_M // group`` positions per tile -> (first rows, first positions, counts, chunk
    indices), int32 tensors on device."""
    per_tile = BLOCK_M // group
    tiles = [
        (start + j, context - length + j, min(per_tile, length - j), index)
        for index, (start, length, context) in enumerate(segments)
        for j in range(0, length, per_tile)
    ]
    count = len(tiles)
    # Each column starts 16-byte aligned whatever the count: Triton specialises a pointer on
    # its alignment, and one compiled variant serves every step.
    flat = torch.zeros(4, -(-count // 4) * 4, dtype=torch.int32)
    if tiles:
        flat[:, :count] = torch.tensor(tiles, dtype=torch.int32).T
    on_device = flat.to(device, non_blocking=True)
    return tuple(on_device[i, :count] for i in range(4))


def invariant_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    decode_tables: torch.Tensor,
    decode_lens: torch.Tensor,
    tiles: tuple[torch.Tensor, ...],
    prefill_tables: torch.Tensor,
    scale: float,
    parallel_splits: bool | None = None,
) -> torch.Tensor:
    """Causal attention of q [T, H, D] over the paged cache ([blocks, block, Hkv, D]): its first
    ``len(decode_lens)`` rows are decode rows (block table and context length each), the rest
    prompt chunks laid out by ``tiles`` (``prefill_tiles``) over ``prefill_tables`` (a row per
    chunk). The step's K/V must be in the cache already.

    parallel_splits: the decode rows' splits run as programs of their own, then a merge
    launch (few decode rows: fills the device), or in turn in one program per row (the same
    bits either way); None: chosen by the decode rows' programs against TARGET_PROGRAMS."""
    heads, head_dim = q.shape[1], q.shape[2]
    kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = heads // kv_heads
    assert group <= BLOCK_M and k_cache.stride() == v_cache.stride()
    assert k_cache.stride(3) == 1 and q.stride(2) == 1
    out = torch.empty_like(q)
    num_decode = decode_lens.shape[0]
    splits = triton.cdiv(decode_tables.shape[1] * block_size, KV_SPLIT) if num_decode else 0
    if parallel_splits is None:
        parallel_splits = num_decode * kv_heads < TARGET_PROGRAMS
    parallel = parallel_splits and splits > 1
    pad_d = triton.next_power_of_2(head_dim)
    shapes = dict(GROUP=group, HEAD_DIM=head_dim, PAD_D=pad_d, BLOCK_M=BLOCK_M)
    launch = dict(num_warps=NUM_WARPS, **pdl.launch_kwargs(q))
    kv_strides = k_cache.stride(0), k_cache.stride(1), k_cache.stride(2)
    programs = tiles[0].shape[0] + (0 if parallel else num_decode)
    if programs:
        _invariant_attention_kernel[(programs, kv_heads)](
            q, k_cache, v_cache, out,
            decode_tables, decode_lens, decode_tables.stride(0), 0 if parallel else num_decode,
            *tiles, prefill_tables, prefill_tables.stride(0),
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *kv_strides, scale * LOG2E,
            BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, KV_SPLIT=KV_SPLIT,
            PRECISION=dot_precision(q.dtype), **shapes, **launch,
        )  # fmt: skip
    if parallel:
        part_m = torch.empty(splits, num_decode, heads, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_m)
        part_acc = torch.empty(*part_m.shape, pad_d, dtype=torch.float32, device=q.device)
        _decode_split_kernel[(num_decode, kv_heads, splits)](
            q, k_cache, v_cache, part_m, part_sum, part_acc,
            decode_tables, decode_lens, decode_tables.stride(0), num_decode,
            q.stride(0), q.stride(1), *kv_strides, scale * LOG2E,
            HEADS=heads, BLOCK_SIZE=block_size, BLOCK_N=BLOCK_N, KV_SPLIT=KV_SPLIT,
            PRECISION=dot_precision(q.dtype), **shapes, **launch,
        )  # fmt: skip
        _decode_merge_kernel[(num_decode, kv_heads)](
            part_m, part_sum, part_acc, out, decode_lens, num_decode,
            out.stride(0), out.stride(1), HEADS=heads, KV_SPLIT=KV_SPLIT, **shapes, **launch,
        )  # fmt: skip
    return out
