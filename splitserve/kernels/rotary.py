"""Rotary position embedding, rotate-half layout, for q and k in one launch.

cos/sin are the model's float32 tables [max_positions, head_dim] (both halves equal) indexed by
each token's position. Products and sums are rounded to the input dtype like the torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    x_ptr, out_ptr, stride_xt, stride_xh, stride_ot, stride_oh, token, heads, c, s,
    HALF: tl.constexpr, PAD_H: tl.constexpr, PAD_HALF: tl.constexpr,
):  # fmt: skip
    h = tl.arange(0, PAD_H)
    d = tl.arange(0, PAD_HALF)
    mask = (h < heads)[:, None] & (d < HALF)[None, :]
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + token * stride_xt + h[:, None] * stride_xh + d[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    lo = (x1 * c).to(dtype).to(tl.float32) + (-x2 * s).to(dtype).to(tl.float32)
    hi = (x2 * c).to(dtype).to(tl.float32) + (x1 * s).to(dtype).to(tl.float32)
    dst = out_ptr + token * stride_ot + h[:, None] * stride_oh + d[None, :]
    tl.store(dst, lo.to(dtype), mask=mask)
    tl.store(dst + HALF, hi.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    stride_cos, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, num_heads, num_kv_heads,
    HALF: tl.constexpr, PAD_HALF: tl.constexpr, PAD_H: tl.constexpr, PAD_HKV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, PAD_HALF)
    dmask = d < HALF
    dtype = q_out_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    c = c[None, :]
    s = s[None, :]
    _rotate_heads(q_ptr, q_out_ptr, stride_qt, stride_qh, stride_qot, stride_qoh, token,
                  num_heads, c, s, HALF, PAD_H, PAD_HALF)  # fmt: skip
    _rotate_heads(k_ptr, k_out_ptr, stride_kt, stride_kh, stride_kot, stride_koh, token,
                  num_kv_heads, c, s, HALF, PAD_HKV, PAD_HALF)  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D], k: [T, Hkv, D] (last dim contiguous; strided views welcome) -> rotated."""
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    tokens, num_heads, head_dim = q.shape
    if tokens == 0:
        return q_out, k_out
    assert q.stride(2) == 1 and k.stride(2) == 1
    assert cos.stride(1) == 1 and sin.stride() == cos.stride() and positions.is_contiguous()
    half = head_dim // 2
    _rotary_kernel[(tokens,)](
        positions, cos, sin, q, k, q_out, k_out,
        cos.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_heads, k.shape[1],
        HALF=half,
        PAD_HALF=triton.next_power_of_2(half),
        PAD_H=triton.next_power_of_2(num_heads),
        PAD_HKV=triton.next_power_of_2(k.shape[1]),
    )  # fmt: skip
    return q_out, k_out


def rotary_embedding_ref(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch reference: the model's RotaryEmbedding.forward."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    return _rotate_ref(q, c, s), _rotate_ref(k, c, s)


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos.to(x.dtype) + rotated * sin.to(x.dtype)).to(x.dtype)
