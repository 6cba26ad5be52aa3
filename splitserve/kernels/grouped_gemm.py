"""The grouped expert GEMM of a mixture-of-experts layer.

Rows arrive sorted by expert: expert ``e`` owns rows ``[offsets[e], offsets[e + 1])`` of the
output, and row ``r`` reads activation row ``rows[r]`` (the token it came from: the gather of
the token permutation is folded into the load) or row ``r`` itself when ``rows`` is None.
Every row is multiplied by its expert's weight ``[N, K]`` (``weight`` is ``[E, N, K]``):
``out[r] = x[rows[r]] @ weight[e].T``.

One launch covers every expert. Each program takes one BLOCK_M tile of one expert's rows and
one BLOCK_N tile of the output columns; each program finds its tile's expert and first row
from the offsets itself (a prefix sum of the experts' tile counts: ``tile_schedule`` is the
same rule in torch), over a grid sized for the worst case (every expert's last tile partly
empty), so nothing is read back to the host, the launch can be captured in a CUDA graph, and
one GEMM is one launch (a schedule of its own launches cost about as much as a decode GEMM
on an H200). Programs past the real tiles return at once. Each weight tile is read by the
programs of its expert only: at decode (a few rows per expert) the launch streams each
routed expert's weight once, which is the bound.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels.decode_attention import dot_precision
from splitserve.kernels.fp8_quant import BLOCK, BlockFp8


@triton.jit
def _grouped_gemm_kernel(
    x_ptr, rows_ptr, w_ptr, out_ptr, offsets_ptr, xs_ptr, ws_ptr,
    N, K, K_SPLIT, num_experts, stride_x, stride_we, stride_wn, stride_out, stride_split,
    stride_xs, stride_wse, stride_wsn,
    GATHER: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PARTIAL: tl.constexpr, PRECISION: tl.constexpr, E_PAD: tl.constexpr,
    SCALED: tl.constexpr, GROUP: tl.constexpr, A_SCALED: tl.constexpr,
):  # fmt: skip
    # This program's tile -> (expert, first row), from the offsets (``tile_schedule``'s rule,
    # computed here: a schedule made by separate launches cost more than a decode GEMM).
    tile = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    real = experts < num_experts
    lo = tl.load(offsets_ptr + experts, mask=real, other=0)
    hi = tl.load(offsets_ptr + experts + 1, mask=real, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, 0)
    expert = tl.sum((ends <= tile).to(tl.int32), 0)
    if expert >= num_experts:
        return
    mine = experts == expert
    first_tile = tl.sum(tl.where(mine, ends - tiles, 0), 0)
    start = tl.sum(tl.where(mine, lo, 0), 0) + (tile - first_tile) * BLOCK_M
    end = tl.sum(tl.where(mine, hi, 0), 0)
    out_rows = start + tl.arange(0, BLOCK_M)
    row_mask = out_rows < end
    in_rows = tl.load(rows_ptr + out_rows, mask=row_mask, other=0) if GATHER else out_rows
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    w_base = w_ptr + expert.to(tl.int64) * stride_we
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_begin = tl.program_id(2) * K_SPLIT
    for k0 in range(0, K_SPLIT, BLOCK_K):  # the last split's steps past K load nothing
        kk = k_begin + k0 + tl.arange(0, BLOCK_K)
        k_mask = kk < K
        a = tl.load(
            x_ptr + in_rows.to(tl.int64)[:, None] * stride_x + kk[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w = tl.load(
            w_base + cols[None, :] * stride_wn + kk[:, None],
            mask=col_mask[None, :] & k_mask[:, None],
            other=0.0,
        )
        if SCALED:  # one group of K: its FP8 dot times the rows' and columns' scales
            group = (k_begin + k0) // GROUP
            w_scale = tl.load(
                ws_ptr + expert.to(tl.int64) * stride_wse + (cols // GROUP) * stride_wsn + group,
                mask=col_mask,
            )
            if A_SCALED:
                a_scale = tl.load(xs_ptr + in_rows.to(tl.int64) * stride_xs + group, mask=row_mask)
                part = tl.dot(a, w, out_dtype=tl.float32)
                acc += part * a_scale[:, None] * w_scale[None, :]
            else:  # rows in their own dtype, the e4m3 weights widened to it (exactly)
                part = tl.dot(a, w.to(a.dtype), out_dtype=tl.float32, input_precision=PRECISION)
                acc += part * w_scale[None, :]
        else:
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
    mask = row_mask[:, None] & col_mask[None, :]
    if not PARTIAL:
        out = out_ptr + out_rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:  # this split's float32 partial sums; the caller adds the splits in a fixed order
        part = out_ptr + tl.program_id(2).to(tl.int64) * stride_split
        tl.store(part + out_rows.to(tl.int64)[:, None] * stride_out + cols[None, :], acc, mask=mask)


def tile_schedule(offsets: torch.Tensor, num_rows: int, block_m: int) -> torch.Tensor:
    """[2, max_tiles] int32: each tile's expert and first row (expert ``E`` and the row count
    past the real tiles): the rule the kernel applies in each program, in torch.

    offsets: [E + 1] row offsets of the experts (on the device; never read on the host)."""
    num_experts = offsets.numel() - 1
    counts = offsets[1:] - offsets[:-1]
    tiles = (counts + block_m - 1) // block_m
    ends = torch.cumsum(tiles, 0)
    max_tiles = -(-num_rows // block_m) + num_experts
    index = torch.arange(max_tiles, device=offsets.device, dtype=ends.dtype)
    expert = torch.searchsorted(ends, index, right=True)
    clamped = expert.clamp(max=num_experts - 1)
    first_tile = ends[clamped] - tiles[clamped]
    start = offsets[clamped] + (index - first_tile) * block_m
    start = torch.where(expert < num_experts, start, offsets[-1])
    return torch.stack([expert, start]).to(torch.int32)


@dataclass(frozen=True)
class GemmTiles:
    """One launch's tiling. split_k > 1 splits each tile's K loop over that many programs,
    whose float32 partial sums are added afterwards in a fixed order (deterministic): with a
    few rows per expert (decode) a tile's programs are few and each walks all of K, so the
    launch is bound by the latency of its loads rather than by bandwidth."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def choose_tiles(num_rows: int, num_experts: int, k: int) -> GemmTiles:
    """16-row tiles when experts get a few rows each (decode), 64 when they get many
    (prefill); 64 columns by 128 of K, 4 stages: on an H200, within 2.5% of the best of a
    sweep of widths, split-K and stages for Qwen3-30B-A3B's experts at 1 to 256 tokens, but
    for the down projection of one token (13.6 us against 11.4 at 128 x 128, 3 stages;
    docs/performance.md). Split-K did not win at any size once the tile schedule moved into
    the kernel."""
    block_m = 16 if num_rows <= 16 * num_experts else 64
    return GemmTiles(block_m, 64, 128, num_stages=4)


def choose_fp8_tiles(num_rows: int, num_experts: int, n: int, quantized: bool) -> GemmTiles:
    """The FP8 launches' tiling (no sweep on an H200 behind it yet: benchmarks/kernels/
    fp8_gemm.py --sweep times the candidates). Unquantized rows (W8A16, a few rows an
    expert: reading the weights is the bound): 16 or 64-row tiles, 64 columns, or 32 where
    64 would leave most of the multiprocessors without a program (a dense projection of a
    few thousand columns). Quantized rows (W8A8, prefill: the tensor cores are the bound):
    128 x 128 tiles on 8 warps for a dense projection, 64 x 128 for experts."""
    per_expert = -(-num_rows // num_experts)
    if not quantized:
        block_m = 16 if per_expert <= 16 else 64
        block_n = 64 if -(-n // 64) * num_experts >= 256 else 32
        return GemmTiles(block_m, block_n, BLOCK, num_stages=4)
    if num_experts == 1:
        return GemmTiles(128, 128, BLOCK, num_warps=8, num_stages=3)
    return GemmTiles(64, 128, BLOCK, num_warps=4, num_stages=3)


INVARIANT_TILES = GemmTiles(64, 64, 128, num_stages=4)
"""Deterministic mode's tiling at every row count (``choose_tiles`` picks BLOCK_M by the rows
routed, and an MMA's sums may differ between tile heights): the prefill tile, no split-K."""


def grouped_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """x: [T, K]; weight: [E, N, K] (last dim contiguous); offsets: [E + 1] int; rows: [M]
    source row of each output row (None: M = T, row r reads x[r]). Returns [M, N].
    tiles: the launch's tiling (default ``choose_tiles``)."""
    return _launch(x, weight, offsets, rows, tiles, x.dtype, None)


def fp8_grouped_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: BlockFp8,
    offsets: torch.Tensor,
    out_dtype: torch.dtype,
    rows: torch.Tensor | None = None,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """``grouped_gemm`` in FP8: x [T, K] e4m3 with x_scale [T, ceil(K / 128)] float32,
    weight's data [E, N, K] e4m3 with its scale [E, ceil(N / 128), ceil(K / 128)]; the
    result in out_dtype. tiles.block_k must divide 128.

    x_scale None: x stays in its float dtype (W8A16) and the products are taken in it, the
    weights widened exactly (for few rows, where reading the weights is the bound and the
    activations' quantization would be a launch for nothing)."""
    num_rows = x.shape[0] if rows is None else rows.numel()
    num_experts, n = weight.data.shape[:2]
    t = tiles or choose_fp8_tiles(num_rows, num_experts, n, x_scale is not None)
    assert BLOCK % t.block_k == 0, "a K step must stay inside one scale group"
    return _launch(x, weight.data, offsets, rows, t, out_dtype, (x_scale, weight.scale))


def fp8_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: BlockFp8,
    out_dtype: torch.dtype,
    tiles: GemmTiles | None = None,
) -> torch.Tensor:
    """A dense FP8 projection: x [M, K] e4m3 (scales [M, ceil(K / 128)]; or x in its float
    dtype and x_scale None) times weight's data [N, K] (block scales): the grouped launch
    with one expert."""
    one = BlockFp8(weight.data.unsqueeze(0), weight.scale.unsqueeze(0))
    offsets = torch.arange(2, device=x.device) * x.shape[0]  # no host copy: graph-safe
    return fp8_grouped_gemm(x, x_scale, one, offsets, out_dtype, None, tiles)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None,
    tiles: GemmTiles | None,
    out_dtype: torch.dtype,
    scales: tuple[torch.Tensor | None, torch.Tensor] | None,
) -> torch.Tensor:
    num_rows = x.shape[0] if rows is None else rows.numel()
    num_experts, n, k = weight.shape
    out = torch.empty((num_rows, n), dtype=out_dtype, device=x.device)
    if num_rows == 0:
        return out
    assert x.stride(1) == 1 and weight.stride(2) == 1, "last dimensions must be contiguous"
    t = tiles or choose_tiles(num_rows, num_experts, k)
    k_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    splits = triton.cdiv(k, k_split)
    target = out if splits == 1 else torch.empty((splits, num_rows, n), device=x.device)
    max_tiles = triton.cdiv(num_rows, t.block_m) + num_experts
    grid = (max_tiles, triton.cdiv(n, t.block_n), splits)
    xs, ws = scales if scales is not None else (x, weight)
    xs = x if xs is None else xs
    _grouped_gemm_kernel[grid](
        x, x if rows is None else rows, weight, target, offsets, xs, ws,
        n, k, k_split, num_experts, x.stride(0), weight.stride(0), weight.stride(1),
        target.stride(-2), target.stride(0) if splits > 1 else 0,
        xs.stride(0), ws.stride(0) if scales else 0, ws.stride(1) if scales else 0,
        GATHER=rows is not None, BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        PARTIAL=splits > 1, PRECISION=dot_precision(x.dtype),
        E_PAD=triton.next_power_of_2(num_experts), num_warps=t.num_warps,
        num_stages=t.num_stages, SCALED=scales is not None, GROUP=BLOCK,
        A_SCALED=scales is not None and scales[0] is not None,
    )  # fmt: skip
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out


def grouped_gemm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    offsets: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch reference, and the CPU path: one ``F.linear`` per expert that has rows (the
    offsets are read on the host)."""
    gathered = x if rows is None else x[rows]
    out = torch.empty((gathered.shape[0], weight.shape[1]), dtype=x.dtype, device=x.device)
    bounds = offsets.tolist()
    for expert, (start, end) in enumerate(itertools.pairwise(bounds)):
        if end > start:
            out[start:end] = F.linear(gathered[start:end], weight[expert])
    return out
