"""Rotary position embedding, rotate-half layout, for q and k in one launch, alone or fused
with the paged K/V write (``rotary_kv_write``: one launch where there were two).

cos/sin are the model's float32 tables [max_positions, head_dim] (both halves equal) indexed by
each token's position. Products and sums are rounded to the input dtype like the torch code.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import pdl
from splitserve.kernels.fp8_act import round_to_e4m3
from splitserve.kernels.fp8_quant import FP8, FP8_MAX, KV_SCALE_VALUES, TINY


@triton.jit
def rotate_half(src, d, c, s, mask, HALF: tl.constexpr):
    """Rotary of the rows at ``src`` (one head each, ``d`` the column index, ``c``/``s`` from
    ``cos_sin``), rounded like the torch code: round(x * cos) + round(rotate_half(x) * sin)."""
    dtype = src.dtype.element_ty
    x = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    partner = tl.where(d < HALF, d + HALF, d - HALF)
    sign = tl.where(d < HALF, -1.0, 1.0)
    x_rot = tl.load(src + partner, mask=mask, other=0.0).to(tl.float32) * sign
    out = (x * c).to(dtype).to(tl.float32) + (x_rot * s).to(dtype).to(tl.float32)
    return out.to(dtype)


@triton.jit
def cos_sin(
    pos_ptr, cos_ptr, sin_ptr, token, stride_cos,
    dtype: tl.constexpr, HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr,
):  # fmt: skip
    """cos and sin of the token's position, rounded to the activation dtype, as [1, PAD_D]."""
    pos = tl.load(pos_ptr + token)
    d = tl.arange(0, PAD_D)
    dmask = d < HEAD_DIM
    c = tl.load(cos_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    s = tl.load(sin_ptr + pos * stride_cos + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)
    return c[None, :], s[None, :]


@triton.jit
def _rotate_heads(
    src, dst, stride_src_h, stride_dst_h, heads, c, s,
    HEAD_DIM: tl.constexpr, PAD_H: tl.constexpr, PAD_D: tl.constexpr,
):  # fmt: skip
    """Rotates ``heads`` heads of one token from src to dst (both at the token's first head)."""
    h = tl.arange(0, PAD_H)[:, None]
    d = tl.arange(0, PAD_D)[None, :]
    mask = (h < heads) & (d < HEAD_DIM)
    rotated = rotate_half(src + h * stride_src_h, d, c, s, mask, HEAD_DIM // 2)
    tl.store(dst + h * stride_dst_h + d, rotated, mask=mask)


@triton.jit
def _rotary_kernel(
    pos_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, q_out_ptr, k_out_ptr,
    stride_cos, stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, PAD_D: tl.constexpr, PAD_H: tl.constexpr, PAD_HKV: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0)
    dtype = q_out_ptr.dtype.element_ty
    c, s = cos_sin(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, dtype, HEAD_DIM, PAD_D)
    _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * stride_qot, stride_qh,
                  stride_qoh, num_heads, c, s, HEAD_DIM, PAD_H, PAD_D)  # fmt: skip
    _rotate_heads(k_ptr + token * stride_kt, k_out_ptr + token * stride_kot, stride_kh,
                  stride_koh, num_kv_heads, c, s, HEAD_DIM, PAD_HKV, PAD_D)  # fmt: skip


@triton.jit
def store_kv(
    dst, h, d, mask, head_ok, rows,
    FP8_MAX: tl.constexpr, TINY: tl.constexpr, HEAD_DIM: tl.constexpr, FP8_ROWS: tl.constexpr,
):  # fmt: skip
    """rows [heads, D] into a cache at dst (the token's first head; h [heads, 1]: the heads'
    offsets in elements, d [1, D]: columns, head_ok [heads, 1]); FP8 rows as
    ``fp8_kv.pack_kv`` makes them: e4m3 values scaled by the row's largest magnitude over
    448, that float32 scale after them (the padding after it stays the pool's zeros)."""
    if FP8_ROWS:
        x = rows.to(tl.float32)
        # IEEE divisions (Triton's "/" is the GPU's approximate one), as torch divides
        scale = tl.math.div_rn(tl.maximum(tl.max(tl.abs(x), 1), TINY)[:, None], FP8_MAX)
        q = round_to_e4m3(tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX))
        tl.store(dst + h + d, q.to(dst.dtype.element_ty), mask=mask)
        tl.store((dst + h + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=head_ok)
    else:
        tl.store(dst + h + d, rows, mask=mask)


@triton.jit
def _rotary_kv_write_kernel(
    pos_ptr, cos_ptr, sin_ptr, qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_cos, stride_qkv, stride_qot, stride_qoh, stride_cb, stride_cs, stride_ch,
    num_heads, num_kv_heads,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PAD_H: tl.constexpr, PAD_HKV: tl.constexpr, PAD_D: tl.constexpr, PDL: tl.constexpr,
    FP8_KV: tl.constexpr, FP8_MAX: tl.constexpr, TINY: tl.constexpr,
):  # fmt: skip
    pdl.launch_dependents(PDL)
    pdl.wait(PDL)
    token = tl.program_id(0)
    dtype = q_out_ptr.dtype.element_ty
    c, s = cos_sin(pos_ptr, cos_ptr, sin_ptr, token, stride_cos, dtype, HEAD_DIM, PAD_D)
    row = qkv_ptr + token * stride_qkv
    _rotate_heads(row, q_out_ptr + token * stride_qot, HEAD_DIM, stride_qoh, num_heads, c, s,
                  HEAD_DIM, PAD_H, PAD_D)  # fmt: skip
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        at = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs
        k_src = row + num_heads * HEAD_DIM
        h = tl.arange(0, PAD_HKV)[:, None]
        d = tl.arange(0, PAD_D)[None, :]
        mask = (h < num_kv_heads) & (d < HEAD_DIM)
        k = rotate_half(k_src + h * HEAD_DIM, d, c, s, mask, HEAD_DIM // 2)
        # Masked lanes zero (a load without ``other`` leaves them undefined on the GPU): an
        # FP8 row's scale is the largest magnitude over every lane, padding included.
        v = tl.load(k_src + num_kv_heads * HEAD_DIM + h * HEAD_DIM + d, mask=mask, other=0.0)
        head_ok = h < num_kv_heads
        store_kv(k_cache_ptr + at, h * stride_ch, d, mask, head_ok, k,
                 FP8_MAX, TINY, HEAD_DIM, FP8_KV)  # fmt: skip
        store_kv(v_cache_ptr + at, h * stride_ch, d, mask, head_ok, v,
                 FP8_MAX, TINY, HEAD_DIM, FP8_KV)  # fmt: skip


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
    _rotary_kernel[(tokens,)](
        positions, cos, sin, q, k, q_out, k_out,
        cos.stride(0), q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
        num_heads, k.shape[1],
        HEAD_DIM=head_dim,
        PAD_D=triton.next_power_of_2(head_dim),
        PAD_H=triton.next_power_of_2(num_heads),
        PAD_HKV=triton.next_power_of_2(k.shape[1]),
    )  # fmt: skip
    return q_out, k_out


def rotary_kv_write(
    positions: torch.Tensor,
    qkv: torch.Tensor,
    num_heads: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """One launch for rotary and the K/V write: qkv [T, (H + 2 * Hkv) * D] (q | k | v) ->
    the rotated q [T, H, D]; the rotated k and v go to the paged caches at their slots
    (negative slots are padding and skipped). Caches are [blocks, block_size, Hkv, D], or
    an FP8 cache's [..., D + 16] rows, which the launch quantizes (``fp8_kv.py``)."""
    tokens = qkv.shape[0]
    _, block_size, num_kv_heads, width = k_cache.shape
    fp8 = k_cache.dtype == FP8
    head_dim = width - KV_SCALE_VALUES if fp8 else width
    assert qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim and qkv.stride(1) == 1
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    assert k_cache.dtype in (qkv.dtype, FP8) and slot_mapping.is_contiguous()
    q_out = torch.empty((tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q_out
    _rotary_kv_write_kernel[(tokens,)](
        positions, cos, sin, qkv, q_out, k_cache, v_cache, slot_mapping,
        cos.stride(0), qkv.stride(0), q_out.stride(0), q_out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        num_heads, num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_SIZE=block_size, PAD_H=triton.next_power_of_2(num_heads),
        PAD_HKV=triton.next_power_of_2(num_kv_heads), PAD_D=triton.next_power_of_2(head_dim),
        FP8_KV=fp8, FP8_MAX=FP8_MAX, TINY=TINY, **pdl.launch_kwargs(qkv),
    )  # fmt: skip
    return q_out


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
