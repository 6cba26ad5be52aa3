"""The FP8 KV cache (``EngineConfig.kv_cache_dtype="fp8"``): e4m3 values, a scale per row.

Each token's K (or V) of one KV head, ``head_dim`` values (MLA: its latent | RoPE key row,
``layers/mla.py: write_latents``), is stored as ``head_dim`` e4m3 values followed by the 4
bytes of its float32 scale (the row's largest magnitude over 448) and 12 zero bytes, which keep
every row 16-byte aligned for the kernels' vector loads: the pool is a uint8 tensor
``[parts, layers, blocks, block_size, heads, head_dim + 16]`` (``KVCacheSpec.scale_values``)
that the layers see through a float8_e4m3fn view. One scale per token and head needs no later
rewrite (a block's scale would change as the block fills) and rides inside the block, so the
block manager, prefix cache, tiered store and prefill -> decode handoff move FP8 blocks as
the opaque byte slices they already move (as uint8: torch's indexing and ``index_copy_`` do
not take float8 on every version), at ``(head_dim + 16) / (2 * head_dim)`` of bfloat16's
bytes (0.56 at head_dim 128, 0.625 at 64; MLA's 576-value rows 0.51). The layers' own writes
and reads also index the bytes and view them as e4m3.

Attention writes each new row quantized and reads the cache through ``unpack_kv``; a prefill
chunk attends to its own K/V rounded the same way (``rounded_kv``), so a prompt computed in
one piece, in chunks, or from a cached prefix sees the same values.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from splitserve.engine.kv_cache_spec import KVCacheGroup
from splitserve.engine.model_config import ModelConfig
from splitserve.kernels.fp8_quant import FP8, FP8_MAX, TINY
from splitserve.kernels.fp8_quant import KV_SCALE_VALUES as SCALE_VALUES


def fp8_groups(groups: list[KVCacheGroup], model: ModelConfig) -> list[KVCacheGroup]:
    """The model's KV cache groups with room for each row's scale (MLA: one latent | RoPE
    row per token, one scale); refused where no attention path reads an FP8 cache yet
    (DeepSeek-V4's compressed caches)."""
    if model.architecture == "deepseek_v4":
        raise ValueError(f"kv_cache_dtype='fp8' is not built for {model.architecture}'s cache")
    return [replace(g, spec=replace(g.spec, scale_values=SCALE_VALUES)) for g in groups]


def is_fp8_cache(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8


def pack_kv(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] -> [..., D + 16] e4m3: the row scaled to e4m3's range, its scale, zeros."""
    scale = x.float().abs().amax(dim=-1, keepdim=True).clamp(min=TINY) / FP8_MAX
    data = (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    pad = x.new_zeros((*x.shape[:-1], SCALE_VALUES - 4), dtype=torch.uint8)
    parts = [data.view(torch.uint8), scale.view(torch.uint8), pad]
    return torch.cat(parts, dim=-1).view(FP8)


def unpack_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 16] e4m3 rows -> [..., D] in dtype (never-written rows, all zero bytes, read
    as zeros)."""
    dim = rows.shape[-1] - SCALE_VALUES
    scale = rows.view(torch.uint8)[..., dim : dim + 4].contiguous().view(torch.float32)
    return (rows[..., :dim].float() * scale).to(dtype)


def rounded_kv(x: torch.Tensor) -> torch.Tensor:
    """x as the cache gives it back."""
    return unpack_kv(pack_kv(x), x.dtype)
