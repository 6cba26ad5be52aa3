"""Matrix-vector products for batch-1 decode, with the ops around them fused in.

At batch 1 a decoder layer is a chain of matrix-vector products bound by reading the weights,
and every op between them (RMSNorm, the residual add, SiLU) costs a launch of its own. This
kernel computes one row x [K] times weight [N, K]^T:

- each program owns BLOCK_N output columns and walks K in BLOCK_K tiles, multiplying in
  registers (no tensor cores, no shared memory: at one row they would only add latency), and
  sums along K once at the end; no split-K, so results never depend on the launch shape;
- prologue (optional): ``RMSNorm(x + residual) * norm_weight``: each program reads the whole
  row once for the sum of squares and normalizes each tile as it multiplies; the first
  program writes the residual sum to a fresh buffer;
- epilogue (optional): a bias, and for a gate|up weight [2 * I, K] ``silu(gate) * up`` (each
  program computes the matching gate and up columns);
- with programmatic dependent launch (``pdl.py``) each program loads its first weight tile
  before it waits for the kernel before it, so the weight stream starts while that one ends.

Rounding follows the torch code: the residual sum, the normalized row, its product with the
norm weight, the projection and SiLU are each rounded to the activation dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.activation import silu_and_mul_ref
from splitserve.kernels.fp8_quant import BLOCK, BlockFp8, dequantize_blocks
from splitserve.kernels.rmsnorm import rms_norm_ref


@triton.jit
def _accumulate(
    acc, acc_up, w, u, kk, K, x_ptr, res_ptr, nw_ptr, rstd, ws_gate, ws_up, dtype: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
    SCALED: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    """Adds one K tile's products: the activation tile (residual added and normalized when
    asked) times the weight tile w (and the up tile u when gated); FP8 weights (SCALED) are
    multiplied by their blocks' scales, folded into the activation (a program's columns share
    one block row of scales: ws_gate and ws_up point at it)."""
    k_mask = kk < K
    a = tl.load(x_ptr + kk, mask=k_mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + kk, mask=k_mask, other=0.0)
        a = (a.to(tl.float32) + r.to(tl.float32)).to(dtype)
    if NORM:
        nw = tl.load(nw_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
        a = ((a.to(tl.float32) * rstd).to(dtype).to(tl.float32) * nw).to(dtype)
    a32 = a.to(tl.float32)
    if SCALED:
        group = kk // GROUP
        acc += w.to(tl.float32) * (a32 * tl.load(ws_gate + group, mask=k_mask, other=0.0))[None, :]
        if GATED:
            scale_up = tl.load(ws_up + group, mask=k_mask, other=0.0)
            acc_up += u.to(tl.float32) * (a32 * scale_up)[None, :]
    else:
        acc += w.to(tl.float32) * a32[None, :]
        if GATED:
            acc_up += u.to(tl.float32) * a32[None, :]
    return acc, acc_up


@triton.jit
def _gemv_kernel(
    x_ptr, res_ptr, res_out_ptr, nw_ptr, w_ptr, b_ptr, out_ptr, ws_ptr,
    N, K, eps, stride_w, up_offset, stride_ws,
    HAS_RESIDUAL: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, HAS_BIAS: tl.constexpr,
    PAD_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    SCALED: tl.constexpr, GROUP: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    dtype = out_ptr.dtype.element_ty
    w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_w
    # FP8 weights: the block row of scales of this program's gate (and up) columns.
    ws_gate = ws_ptr + (pid * BLOCK_N // GROUP) * stride_ws
    ws_up = ws_ptr + ((pid * BLOCK_N + N) // GROUP) * stride_ws

    # The first K tile of the weights needs nothing from the kernel before: under PDL it
    # streams in while that kernel finishes.
    kk = tl.arange(0, BLOCK_K)
    w_mask = col_mask[:, None] & (kk < K)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    u = w
    if GATED:
        u = tl.load(w_rows + up_offset + kk[None, :], mask=w_mask, other=0.0)
    pdl.wait(PDL)

    rstd = 0.0
    if NORM:
        k_all = tl.arange(0, PAD_K)
        row = tl.load(x_ptr + k_all, mask=k_all < K, other=0.0)
        if HAS_RESIDUAL:
            res = tl.load(res_ptr + k_all, mask=k_all < K, other=0.0)
            row = (row.to(tl.float32) + res.to(tl.float32)).to(dtype)
            if pid == 0:
                tl.store(res_out_ptr + k_all, row, mask=k_all < K)
        row32 = row.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(row32 * row32, 0) / K + eps)

    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc, acc_up = _accumulate(acc, acc_up, w, u, kk, K, x_ptr, res_ptr, nw_ptr, rstd, ws_gate,
                              ws_up, dtype, HAS_RESIDUAL, NORM, GATED, SCALED, GROUP)  # fmt: skip
    for k0 in range(BLOCK_K, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        w_mask = col_mask[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        if GATED:
            u = tl.load(w_rows + up_offset + kk[None, :], mask=w_mask, other=0.0)
        acc, acc_up = _accumulate(acc, acc_up, w, u, kk, K, x_ptr, res_ptr, nw_ptr, rstd,
                                  ws_gate, ws_up, dtype, HAS_RESIDUAL, NORM, GATED, SCALED,
                                  GROUP)  # fmt: skip

    out = tl.sum(acc, 1)
    if HAS_BIAS:
        out += tl.load(b_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
    out = out.to(dtype)
    if GATED:
        gate = out.to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        out = (act * tl.sum(acc_up, 1).to(dtype).to(tl.float32)).to(dtype)
    tl.store(out_ptr + cols, out, mask=col_mask)


@dataclass(frozen=True)
class Tiles:
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int = 3


def choose_tiles(k: int, device: torch.device | None = None, fp8: bool = False) -> Tiles:
    """Four columns per program (enough programs for every SM at any width the models have)
    and 1024-wide K tiles; 8 warps for short rows, 4 for long ones.

    Measured on an H200 with weights streamed from memory (benchmarks/gpu/fastpath.py
    --sweep, 34 tiles): the sweep's best for every SmolLM2-135M projection; on Llama-3-8B's
    within 1% of the best for o, down and gate|up and 5% for q|k|v.

    Off the GPU (Triton's interpreter, which runs one program after another in Python) 64
    columns per program: a column's sum does not depend on the tile's width, and the tests'
    model runs took 16 times as many programs with four.

    fp8: e4m3 weights take eight columns a program, 1024-wide K tiles and 4 warps: the
    sweep's best on an H200 for Llama-3-8B's o, gate|up and down at one row
    (`benchmarks.kernels.fp8_gemm --sweep`: 6.0 / 34.0 / 17.6 µs, 2.25x / 1.65x / 1.83x the
    bfloat16 product's speed; q|k|v's best was four columns of 2048, 9.4 µs, 1.65x)."""
    if device is not None and device.type != "cuda":
        return Tiles(64, 1024, num_warps=4)
    if fp8:
        return Tiles(8, 1024, num_warps=4)
    return Tiles(4, 1024, num_warps=8 if k <= 2048 else 4)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
    tiles: Tiles | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Returns (out, x + residual) for one row x [1, K] and weight [N, K] (or [2 * I, K]):

    out = linear(h, weight, bias) with h = x, or RMSNorm(x + residual) * norm_weight when
    norm_weight is given; gated: silu(h @ gate.T) * (h @ up.T), [1, I]. The second value is
    None unless a residual was given.

    weight_scale: the weight is FP8 (e4m3) with one float32 scale per 128 x 128 block
    (``kernels/fp8_quant.py``); the row stays in its dtype and meets the dequantized weight
    (W8A16: one byte a weight read, no rounding of the row).
    """
    assert x.shape[0] == 1 and x.is_contiguous() and weight.stride(1) == 1
    k = x.shape[1]
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    assert weight.shape[1] == k
    assert residual is None or norm_weight is not None, "the residual sum feeds the norm"
    assert residual is None or residual.is_contiguous()
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    res_out = None if residual is None else torch.empty_like(x)
    t = tiles or choose_tiles(k, x.device, fp8=weight_scale is not None)
    if weight_scale is not None:  # a program's columns (gate's and up's) in one block row
        block_n = t.block_n
        while gated and n % block_n:
            block_n //= 2
        t = replace(t, block_n=block_n)
        assert BLOCK % t.block_n == 0 and weight_scale.stride(1) == 1
    _gemv_kernel[(triton.cdiv(n, t.block_n),)](
        x, x if residual is None else residual, x if res_out is None else res_out,
        x if norm_weight is None else norm_weight, weight, x if bias is None else bias, out,
        x if weight_scale is None else weight_scale,
        n, k, eps, weight.stride(0), n * weight.stride(0),
        0 if weight_scale is None else weight_scale.stride(0),
        HAS_RESIDUAL=residual is not None, NORM=norm_weight is not None, GATED=gated,
        HAS_BIAS=bias is not None, PAD_K=triton.next_power_of_2(k) if norm_weight is not None
        else 1, BLOCK_N=t.block_n, BLOCK_K=t.block_k, SCALED=weight_scale is not None,
        GROUP=BLOCK, num_warps=t.num_warps, num_stages=t.num_stages, **pdl.launch_kwargs(x),
    )  # fmt: skip
    return out, res_out


def gemv_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    gated: bool = False,
    weight_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch reference: the model's own ops, one after the other (an FP8 weight
    dequantized to float32 and the product taken in float32)."""
    h = x if residual is None else x + residual
    a = h if norm_weight is None else rms_norm_ref(h, norm_weight, eps)
    if weight_scale is None:
        out = F.linear(a, weight, bias)
    else:
        real = dequantize_blocks(BlockFp8(weight, weight_scale))
        out = F.linear(a.float(), real, None if bias is None else bias.float()).to(a.dtype)
    return (silu_and_mul_ref(out) if gated else out), None if residual is None else h
