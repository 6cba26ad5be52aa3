"""The dense FP8 projection: x [M, K] times a block-scaled e4m3 weight [N, K] (issue 42).

The grouped expert launch (``grouped_gemm.py``) serves a dense projection as one expert, but
its shape is the experts': each program finds its expert from the offsets, loads its weight
tile as [K, N] and scales it per column. This launch is for one weight only:

- each program owns a BLOCK_M x BLOCK_N tile of the output (split along K over SPLIT_K
  programs where the tiles alone are too few to fill the GPU: a decode step's 64 rows give a
  projection of 4,096 columns only 64 tiles of 64), programs taken in groups of GROUP_M row
  tiles so that a prefill's weight tiles are read from L2 by the row tiles that share them;
- the weight tile loads as it lies in memory, [BLOCK_N, BLOCK_K] with K contiguous, and
  enters the dot transposed (the K-major operand an FP8 MMA takes), without masks where N
  and K are whole tiles (EVEN_N, EVEN_K);
- a tile of at most 128 columns lies in one block row of the weight's scales, so each step
  of K (one 128-channel group) multiplies its dot by one weight scale and the rows' scales
  (W8A8), or by the weight scale alone with the rows in their own dtype and the e4m3 weight
  widened to it, which is exact (W8A16, decode: the weight's bytes are the bound).

Each step's dot is taken apart from the accumulator and added scaled, in K's order, so the
result is the dequantizing reference's sum (``fp8_quant.fp8_matmul_ref``) up to the order of
the products inside a group; split-K's float32 partial sums are added in split order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels.decode_attention import dot_precision
from splitserve.kernels.fp8_quant import BLOCK, BlockFp8


@triton.jit
def _fp8_dense_kernel(
    x_ptr, w_ptr, out_ptr, xs_ptr, ws_ptr, M, N, K, K_SPLIT,
    stride_x, stride_w, stride_out, stride_split, stride_xs, stride_ws,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, GROUP: tl.constexpr, A_SCALED: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    # program -> (row tile, column tile), GROUP_M row tiles at a time along the columns
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    height = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % height
    pid_n = (pid % per_group) // height
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    ws_row = ws_ptr + (pid_n * BLOCK_N // GROUP) * stride_ws  # BLOCK_N divides GROUP
    k_begin = tl.program_id(1) * K_SPLIT
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K_SPLIT, BLOCK_K):  # the last split's steps past K load nothing
        kk = k_begin + k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            a = tl.load(x_rows + kk[None, :], mask=row_mask[:, None], other=0.0)
        else:
            k_mask = kk < K
            a = tl.load(x_rows + kk[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        if EVEN_N and EVEN_K:
            w = tl.load(w_rows + kk[None, :])
        elif EVEN_K:
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None], other=0.0)
        else:
            w = tl.load(w_rows + kk[None, :], mask=col_mask[:, None] & k_mask[None, :], other=0.0)
        group = (k_begin + k0) // GROUP
        w_scale = tl.load(ws_row + group)
        if A_SCALED:
            a_scale = tl.load(xs_ptr + rows.to(tl.int64) * stride_xs + group, mask=row_mask)
            part = tl.dot(a, tl.trans(w), out_dtype=tl.float32)
            acc += part * (a_scale * w_scale)[:, None]
        else:  # rows in their own dtype, the e4m3 weights widened to it (exactly)
            part = tl.dot(
                a, tl.trans(w.to(a.dtype)), out_dtype=tl.float32, input_precision=PRECISION
            )
            acc += part * w_scale
    mask = row_mask[:, None] & col_mask[None, :]
    offsets = rows.to(tl.int64)[:, None] * stride_out + cols[None, :]
    if PARTIAL:  # this split's float32 partial sums; the caller adds the splits in order
        tl.store(out_ptr + tl.program_id(1).to(tl.int64) * stride_split + offsets, acc, mask=mask)
    else:
        tl.store(out_ptr + offsets, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class DenseTiles:
    """One launch's tiling: block_n must divide 128 (a tile's columns share one scale row),
    block_k must be 128 (one scale group a step); split_k > 1 splits K over that many
    programs a tile."""

    block_m: int
    block_n: int
    block_k: int = BLOCK
    split_k: int = 1
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4


def choose_dense_tiles(m: int, n: int, k: int, quantized: bool, sms: int) -> DenseTiles:
    """Unquantized rows (W8A16, decode: the weight's bytes are the bound): 16-row tiles of 32
    columns, split along K until the tiles reach the multiprocessors. Quantized rows (W8A8):
    64 x 64 tiles up to 64 rows, 64 x 128 beyond. On an H100 (``benchmarks/kernels/fp8_gemm.py
    --sweep`` over Llama-3-8B's projections) these were the best or within 10% of the best
    tiling at 1, 64, 256 and 8,192 rows, but for the down projection of 8,192 (128 x 128 on
    8 warps, 8% faster)."""
    if quantized:
        return DenseTiles(64, 64 if m <= 64 else 128)
    tiles = -(-m // 16) * -(-n // 32)
    split = 1
    while tiles * split < sms and k // (BLOCK * split * 2) >= 4:
        split *= 2
    return DenseTiles(16, 32, split_k=split)


def multiprocessors(device: torch.device) -> int:
    """The device's streaming multiprocessors (an H100's or H200's 132 where it has none)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def fp8_dense_gemm(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    weight: BlockFp8,
    out_dtype: torch.dtype,
    tiles: DenseTiles | None = None,
) -> torch.Tensor:
    """x [M, K] e4m3 with x_scale [M, ceil(K / 128)] float32 (W8A8), or x in its float dtype
    and x_scale None (W8A16), times weight's data [N, K] e4m3 (scales [ceil(N / 128),
    ceil(K / 128)]) -> [M, N] in out_dtype."""
    m, k = x.shape
    n = weight.data.shape[0]
    out = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0:
        return out
    assert x.stride(1) == 1 and weight.data.stride(1) == 1, "last dimensions must be contiguous"
    t = tiles or choose_dense_tiles(m, n, k, x_scale is not None, multiprocessors(x.device))
    assert t.block_k == BLOCK and BLOCK % t.block_n == 0, "a tile must lie in one scale block"
    k_split = triton.cdiv(triton.cdiv(k, t.split_k), t.block_k) * t.block_k
    splits = triton.cdiv(k, k_split)
    target = out if splits == 1 else torch.empty((splits, m, n), device=x.device)
    xs = x if x_scale is None else x_scale
    grid = (triton.cdiv(m, t.block_m) * triton.cdiv(n, t.block_n), splits)
    _fp8_dense_kernel[grid](
        x, weight.data, target, xs, weight.scale, m, n, k, k_split,
        x.stride(0), weight.data.stride(0), target.stride(-2),
        target.stride(0) if splits > 1 else 0, xs.stride(0), weight.scale.stride(0),
        BLOCK_M=t.block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k, GROUP_M=t.group_m,
        GROUP=BLOCK, A_SCALED=x_scale is not None, EVEN_N=n % t.block_n == 0,
        EVEN_K=k % k_split == 0, PARTIAL=splits > 1, PRECISION=dot_precision(x.dtype),
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    if splits > 1:
        out.copy_(target.sum(dim=0))
    return out
