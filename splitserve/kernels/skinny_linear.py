"""Linear layers for a handful of rows (small-batch decode), with the ops around them fused in.

At batch 1 a decoder layer is a chain of matrix-vector products; on the GPU the products are
bound by reading the weights, and everything between them (RMSNorm, the residual add, SiLU)
costs a launch of its own. This kernel folds those into the product:

- prologue: ``RMSNorm(x + residual)`` of each row, computed from the row itself (one pass for
  the sum of squares, one while multiplying), so the norm needs no launch; the residual sum is
  written by the first column-program into a fresh buffer;
- epilogue: an optional bias and, for the gate|up projection, ``silu(gate) * up`` (each program
  computes the matching gate and up columns).

Each program owns BLOCK_N output columns for up to BLOCK_M rows and walks the whole K
dimension, so results do not depend on how many programs run (no split-K, no atomics).
Rounding follows the torch code: the residual sum, the normalized row, the product with the
norm weight, the projection and SiLU are each rounded to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _skinny_linear_kernel(
    x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, b_ptr, out_ptr,
    M, N, K, eps,
    stride_x, stride_res, stride_res_out, stride_w, stride_out, up_offset,
    HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PRECISION: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    dtype = out_ptr.dtype.element_ty
    k_base = tl.arange(0, BLOCK_K)

    rstd = tl.zeros([BLOCK_M], tl.float32)
    if NORM:
        sum_sq = tl.zeros([BLOCK_M], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k_base
            mask = row_mask[:, None] & (kk < K)[None, :]
            a = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
            if HAS_RESIDUAL:
                r = tl.load(res_ptr + rows[:, None] * stride_res + kk[None, :], mask=mask, other=0)
                a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
                if pid_n == 0:
                    dst = res_out_ptr + rows[:, None] * stride_res_out + kk[None, :]
                    tl.store(dst, a, mask=mask)
            a32 = a.to(tl.float32)
            sum_sq += tl.sum(a32 * a32, 1)
        rstd = tl.rsqrt(sum_sq / K + eps)

    # One row (USE_DOT false): products summed along K in registers, no shared memory; more
    # rows: tensor-core dots over BLOCK_M rows.
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_k = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_k_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + k_base
        k_mask = kk < K
        mask = row_mask[:, None] & k_mask[None, :]
        a = tl.load(x_ptr + rows[:, None] * stride_x + kk[None, :], mask=mask, other=0.0)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + rows[:, None] * stride_res + kk[None, :], mask=mask, other=0.0)
            a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
        if NORM:
            nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            normed = (a.to(tl.float32) * rstd[:, None]).to(dtype)
            a = (normed.to(tl.float32) * nw[None, :]).to(dtype)
        w_mask = col_mask[:, None] & k_mask[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        if GATED:
            u = tl.load(w_rows + up_offset + kk[None, :], mask=w_mask, other=0.0)
        if USE_DOT:
            acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
            if GATED:
                acc_up += tl.dot(a, tl.trans(u), input_precision=PRECISION)
        else:
            a32 = a.to(tl.float32)  # [1, BLOCK_K]
            acc_k += w.to(tl.float32) * a32
            if GATED:
                acc_k_up += u.to(tl.float32) * a32
    if not USE_DOT:
        acc = tl.sum(acc_k, 1)[None, :]
        acc_up = tl.sum(acc_k_up, 1)[None, :]

    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(dtype)
    if GATED:
        gate = out.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (act * acc_up.to(dtype).to(tl.float32)).to(dtype)
    dst = out_ptr + rows[:, None] * stride_out + cols[None, :]
    tl.store(dst, out, mask=row_mask[:, None] & col_mask[None, :])


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    use_dot: bool = True


MAX_ROWS = 16
"""Row count up to which the engine takes this kernel (one BLOCK_M tile)."""


def choose_tiles(n: int, k: int) -> Tiles:
    """Enough column-programs to keep every SM streaming weights (>= ~2 per SM on an H200),
    with K tiles long enough that each load is a few KB."""
    block_n = 16 if n <= 8192 else 32
    block_k = 256 if k >= 1024 else 128
    return Tiles(block_n, block_k, num_warps=4, num_stages=4)


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out, x + residual) where out is, for x [M, K] and weight [N, K]:

    - ``linear(h, weight, bias)`` with h = x (+ residual), then RMSNorm(h) * norm_weight when
      norm_weight is given;
    - gated: weight is [2 * I, K] laid out gate | up and out = silu(h @ gate.T) * (h @ up.T).

    The second value is None unless a residual was given.
    """
    rows, k = x.shape
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    assert residual is None or norm_weight is not None, "the residual sum feeds the norm"
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(x)
    if rows == 0:
        return out, res_out
    t = tiles or choose_tiles(n, k)
    block_m = MAX_ROWS if t.use_dot else 1
    assert t.use_dot or rows == 1, "the register (non-dot) variant computes one row"
    grid = (triton.cdiv(n, t.block_n), triton.cdiv(rows, block_m))
    res = x if residual is None else residual
    assert res.stride(1) == 1
    _skinny_linear_kernel[grid](
        x, res, x if res_out is None else res_out,
        x if norm_weight is None else norm_weight, weight, x if bias is None else bias, out,
        rows, n, k, eps,
        x.stride(0), res.stride(0), x.stride(0) if res_out is None else res_out.stride(0),
        weight.stride(0), out.stride(0), n * weight.stride(0),
        HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None, GATED=gated,
        HAS_BIAS=bias is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        USE_DOT=t.use_dot, BLOCK_M=block_m, BLOCK_N=t.block_n, BLOCK_K=t.block_k,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )  # fmt: skip
    return out, res_out


def skinny_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference: the model's own ops, one after the other."""
    h = x if residual is None else x + residual
    a = h
    if norm_weight is not None:
        h32 = h.float()
        a = norm_weight * (h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)
    out = F.linear(a, weight, bias)
    if gated:
        gate, up = out.split(out.shape[-1] // 2, dim=-1)
        out = F.silu(gate) * up
    return out, None if residual is None else h
