"""RMSNorm, optionally fused with the residual add before it.

Semantics are those of ``engine/layers/norm.py``: the residual sum is rounded to the input dtype,
normalized in float32, rounded to the input dtype, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    hidden,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        summed = (x + res).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.rsqrt(mean_sq + eps)).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (normed * w).to(dtype), mask=mask)


def _num_warps(hidden: int) -> int:
    """One warp per 512 values of the row, as a power of two (Triton's rule) from 1 to 16:
    DeepSeek-V3's 7,168 takes 8."""
    return min(16, 1 << max(0, (hidden // 512).bit_length() - 1))


def _launch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty_like(x2)
    res2 = None if residual is None else residual.reshape(-1, x.shape[-1])
    res_out = None if res2 is None else torch.empty_like(x2)
    if x2.shape[0]:
        assert x2.stride(1) == 1 and weight.is_contiguous()
        hidden = x2.shape[1]
        _rmsnorm_kernel[(x2.shape[0],)](
            x2,
            x2 if res2 is None else res2,
            weight,
            out,
            out if res_out is None else res_out,
            x2.stride(0),
            x2.stride(0) if res2 is None else res2.stride(0),
            out.stride(0),
            out.stride(0) if res_out is None else res_out.stride(0),
            hidden,
            eps,
            HAS_RESIDUAL=res2 is not None,
            BLOCK=triton.next_power_of_2(hidden),
            num_warps=_num_warps(hidden),
            **pdl.launch_kwargs(x2),
        )
    new_res = None if res_out is None else res_out.view(x.shape)
    return out.view(x.shape), new_res


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [..., hidden] -> RMSNorm(x) in x's dtype."""
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (RMSNorm(x + residual), x + residual); neither input is modified."""
    out, new_res = _launch(x, residual, weight, eps)
    assert new_res is not None
    return out, new_res


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch reference: the model's CPU RMSNorm."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    summed = x + residual
    return rms_norm_ref(summed, weight, eps), summed
