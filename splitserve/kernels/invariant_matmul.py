"""The batch-invariant GEMM of deterministic mode: ``x [M, K] @ weight[N, K].T (+ bias)`` whose
every output row is the same bits whatever M is and wherever the row sits among the M.

cuBLAS (``F.linear``) picks its tile and its split-K by the row count, so a row's sums run in
another order at 1 row than at 64; the GEMV of one-row steps is another order again. Here:

- one tile shape (``BLOCK_M`` x ``BLOCK_N`` x ``BLOCK_K``) and one warp count at every M: a
  row's products and sums are the same ``tl.dot`` instructions on the same K tiles, and an
  MMA's output row depends only on its own input row (rows past M are zeros, which touch no
  other row);
- the K loop in one order, and for parallelism at small M a split-K whose split count comes
  from (N, K) alone (``num_splits``): each split's float32 sums are added in split order.
  At small M each split is a program of its own, writing its partials to ``[S, M, N]`` for a
  second launch to add; at large M a program runs its splits one after the other and adds
  them the same way, in registers (no partials' traffic). Either way the same bits.

``M`` is never specialised (``do_not_specialize``): Triton compiles a variant for an integer
argument equal to 1, and one row must run the code that 256 rows run.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.decode_attention import dot_precision

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 64
NUM_WARPS, NUM_STAGES = 8, 3  # at 4 warps the splits-in-turn variant spilled (sm_90a)
TARGET_PROGRAMS = 128
"""About one program per multiprocessor of an H100/H200 (132): the split-K fills the device at
one row. A constant rather than the device's count, so that every GPU model splits alike."""
MIN_K_TILES = 8
"""The fewest K tiles a split keeps (below that the partials' traffic outweighs the gain)."""


@triton.jit
def _split_product(
    x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, first, k_per_split, stride_x, stride_w,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    """The float32 sums of one split's K range [first, first + k_per_split), in K order."""
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(first, first + k_per_split, BLOCK_K):
        ks = k0 + depth
        k_ok = ks < K
        a_mask = row_ok[:, None] & k_ok[None, :]  # rows past M are zeros: no other row changes
        a = tl.load(x_ptr + rows[:, None] * stride_x + ks[None, :], mask=a_mask, other=0.0)
        b_mask = col_ok[None, :] & k_ok[:, None]
        b = tl.load(w_ptr + cols[None, :] * stride_w + ks[:, None], mask=b_mask, other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    return acc


@triton.jit(do_not_specialize=["M"])
def _invariant_matmul_kernel(
    x_ptr, w_ptr, bias_ptr, out_ptr, M, N, K, k_per_split, stride_x, stride_w, stride_out,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    if PARTIAL:  # one split per program, into [S, M, N] float32 (summed by _sum_splits_kernel)
        split = tl.program_id(2)
        acc = _split_product(
            x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, split * k_per_split, k_per_split,
            stride_x, stride_w, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        tl.store(out_ptr + (split * M + rows[:, None]) * N + cols[None, :], acc, mask=mask)
    else:  # every split in turn, added in split order as _sum_splits_kernel adds them
        acc = _split_product(
            x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, 0, k_per_split,
            stride_x, stride_w, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        for split in tl.static_range(1, SPLITS):
            acc += _split_product(
                x_ptr, w_ptr, rows, cols, row_ok, col_ok, K, split * k_per_split, k_per_split,
                stride_x, stride_w, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K,
            )  # fmt: skip
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        at = rows[:, None] * stride_out + cols[None, :]
        tl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _sum_splits_kernel(
    part_ptr, bias_ptr, out_ptr, M, N, stride_out,
    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    acc = tl.load(part_ptr + row * N + cols, mask=ok, other=0.0)
    for split in tl.static_range(1, SPLITS):
        acc += tl.load(part_ptr + (split * M + row) * N + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def num_splits(n: int, k: int) -> int:
    """The split-K count of an [N, K] weight: a power of two doubled while the programs of one
    row tile stay within ``TARGET_PROGRAMS`` and each split keeps ``MIN_K_TILES`` K tiles. It
    reads neither M nor the device."""
    tiles, k_tiles = triton.cdiv(n, BLOCK_N), triton.cdiv(k, BLOCK_K)
    splits = 1
    while tiles * splits * 2 <= TARGET_PROGRAMS and k_tiles // (splits * 2) >= MIN_K_TILES:
        splits *= 2
    return splits


def invariant_matmul(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    parallel_splits: bool | None = None,
) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T (+ bias) -> [..., N] in x's dtype, every row batch-invariant.

    parallel_splits: the splits of a weight with several run as programs of their own, their
    partials summed by a second launch (small M: fills the device), or one after the other in
    each program (large M: no partials to write); the same bits either way. None: chosen by M.
    """
    n, k = weight.shape
    flat = x.reshape(-1, k).contiguous()
    m = flat.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*x.shape[:-1], n)
    assert weight.stride(1) == 1
    splits = num_splits(n, k)
    k_per_split = triton.cdiv(triton.cdiv(k, BLOCK_K), splits) * BLOCK_K
    tiles = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    if parallel_splits is None:
        parallel_splits = tiles[0] * tiles[1] < TARGET_PROGRAMS
    partial = splits > 1 and parallel_splits
    target = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if partial else out
    bias_arg = weight if bias is None else bias
    _invariant_matmul_kernel[(*tiles, splits if partial else 1)](
        flat, weight, bias_arg, target, m, n, k, k_per_split,
        flat.stride(0), weight.stride(0), out.stride(0),
        SPLITS=splits, HAS_BIAS=bias is not None, PARTIAL=partial,
        PRECISION=dot_precision(x.dtype), BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        num_warps=NUM_WARPS, num_stages=NUM_STAGES, **pdl.launch_kwargs(x),
    )  # fmt: skip
    if partial:
        block = 1024
        _sum_splits_kernel[(m, triton.cdiv(n, block))](
            target, bias_arg, out, m, n, out.stride(0),
            SPLITS=splits, HAS_BIAS=bias is not None, BLOCK=block, **pdl.launch_kwargs(x),
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


def invariant_matmul_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch reference, in float32."""
    out = x.float() @ weight.float().T
    return out if bias is None else out + bias.float()
