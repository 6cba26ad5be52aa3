"""SiLU-and-mul: [T, 2 * I] laid out gate | up -> silu(gate) * up, shape [T, I]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from splitserve.kernels import pdl


@triton.jit
def _silu_and_mul_kernel(
    x_ptr, out_ptr, stride_x, stride_out, inter, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    # Rounded to the input dtype before the product, like F.silu(gate) * up in torch.
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (act * up).to(dtype), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * I] (last dim contiguous) -> [T, I] in x's dtype."""
    tokens, width = x.shape
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    assert x.stride(1) == 1, "last dimension must be contiguous"
    block = min(1024, triton.next_power_of_2(inter))
    grid = (tokens, triton.cdiv(inter, block))
    _silu_and_mul_kernel[grid](
        x, out, x.stride(0), out.stride(0), inter, BLOCK=block, **pdl.launch_kwargs(x)
    )
    return out


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """The torch reference: exactly the model's CPU code."""
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return F.silu(gate) * up
