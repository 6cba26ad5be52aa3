"""Multi-head latent attention (DeepSeek-V2/V3) over a paged cache of latents.

Each token leaves one entry in its layer's cache, ``kv_lora_rank`` values of the normed latent
then ``qk_rope_head_dim`` of the rotated RoPE key that every head shares: the cache is one
"head" of ``latent_dim`` values (``engine/kv_cache_spec.py``), written at ``slot_mapping``.

Queries come from a low-rank path (``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``) or one
``q_proj`` (V2-Lite); the first projection is fused with ``kv_a_proj_with_mqa`` (both read the
same normed hidden states). ``kv_b_proj`` [H * (nope + v), kv_lora_rank] holds W_UK (the first
``nope`` rows of each head) and W_UV (the next ``v``):

- prefill expands the context's latents into per-head keys and values and runs causal
  attention over them;
- decode stays in the latent space (the absorbed form): q_nope times W_UK is a query on the
  latent, scored with the RoPE query against the cache's two parts, one attention with a
  single KV head of ``latent_dim``; the weighted latent goes out through W_UV.

The RoPE dimensions of an interleaved checkpoint are reordered to the rotate-half layout at
load (``deinterleave_rope``), which the engine's rotary applies: q and k are permuted alike,
so their products are unchanged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillSegment,
    TorchAttention,
    chunk_attention,
    read_context,
)
from splitserve.engine.layers.fp8_kv import is_fp8_cache, pack_kv, unpack_kv
from splitserve.engine.layers.linear import dense, linear, norm_linear
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.rotary import RotaryEmbedding, softmax_scale_factor
from splitserve.engine.model_config import MLAConfig, ModelConfig

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm and kv_a_layernorm take transformers' default epsilon, not the config's."""


class LatentUpProjection(nn.Module):
    """kv_b_proj's weight [H * (nope + v), kv_lora_rank]: applied whole in prefill, split
    into W_UK and W_UV for decode. Not an ``nn.Linear``, so that no CPU weight format
    replaces it (decode reads the weight itself)."""

    def __init__(self, kv_lora_rank: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, kv_lora_rank))
        nn.init.uniform_(self.weight, -(kv_lora_rank**-0.5), kv_lora_rank**-0.5)

    def forward(self, latent: torch.Tensor) -> torch.Tensor:
        return F.linear(latent, self.weight)


class MLAAttention(nn.Module):
    """Called like ``LlamaAttention``: (x, residual, norm, positions, rotary, meta) ->
    (o_proj(attention(norm(x + residual))), x + residual)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        assert cfg.mla is not None
        if cfg.attention_bias:
            raise ValueError("MLA with attention_bias is not supported")
        mla = self.mla = cfg.mla
        self.num_heads = heads = cfg.num_heads
        self.q_size = mla.q_lora_rank or heads * mla.qk_head_dim
        self.in_proj = nn.Linear(cfg.hidden_size, self.q_size + mla.latent_dim, bias=False)
        """q_a_proj (or q_proj) | kv_a_proj_with_mqa."""
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: nn.Linear | None = None
        if mla.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(mla.q_lora_rank, heads * mla.qk_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = LatentUpProjection(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        )
        self.o_proj = nn.Linear(heads * mla.v_head_dim, cfg.hidden_size, bias=False)
        self.scale = mla.qk_head_dim**-0.5 * softmax_scale_factor(cfg.rope_scaling)
        self.latent_cache = torch.empty(0)
        """[num_blocks, block_size, 1, latent_dim], bound by the model runner."""
        self.kernel = not isinstance(backend, TorchAttention)
        """The "triton" attention backend: decode takes ``kernels/mla_decode.py``."""

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm: RMSNorm,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        mla, tokens = self.mla, x.shape[0]
        projected, residual = norm_linear(x, residual, norm, self.in_proj)
        q, latent = projected.split([self.q_size, mla.latent_dim], dim=-1)
        if self.q_a_layernorm is not None and self.q_b_proj is not None:
            q = dense(self.q_a_layernorm(q.contiguous()), self.q_b_proj)
        q = q.view(tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        kv, k_rope = latent.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        q_rope, k_rope = rotary(positions, q_rope.contiguous(), k_rope.reshape(tokens, 1, -1))
        entry = torch.cat([self.kv_a_layernorm(kv.contiguous()), k_rope[:, 0]], dim=-1)
        entry = write_latents(self.latent_cache, meta.slot_mapping, entry)
        out = q.new_empty(tokens, self.num_heads, mla.v_head_dim)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self.decode(q_nope[:n], q_rope[:n], meta)
        for seg in meta.prefills:
            rows = slice(seg.start, seg.start + seg.length)
            out[rows] = self.prefill(q_nope[rows], q_rope[rows], entry[rows], seg)
        return linear(out.view(tokens, -1), self.o_proj), residual

    def absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_UK [H, nope, kv_lora_rank], W_UV [H, v, kv_lora_rank]), views of kv_b_proj."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        return weight[:, : mla.qk_nope_head_dim], weight[:, mla.qk_nope_head_dim :]

    def decode(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The absorbed form for decode rows: [B, H, nope] and [B, H, rope] -> [B, H, v]."""
        w_uk, w_uv = self.absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        query = torch.cat([q_latent, q_rope], dim=-1)
        attend = mla_decode
        if self.kernel:
            from splitserve.kernels.mla_decode import mla_decode_attention as attend  # lazy: Triton
        latent = attend(
            query,
            self.latent_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            self.scale,
            self.mla.kv_lora_rank,
        )
        return torch.bmm(latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def prefill(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        entry: torch.Tensor,
        seg: PrefillSegment,
    ) -> torch.Tensor:
        """A chunk's queries over its context, keys and values expanded from the latents
        (the chunk's own ``entry`` [L, latent_dim]; earlier ones read from the cache)."""
        mla = self.mla
        if seg.context_len > seg.length:
            cached = read_context(self.latent_cache, seg.block_table[None, :], entry.dtype)
            entry = cached[0, : seg.context_len, 0]
        context = entry.shape[0]
        kv = self.kv_b_proj(entry[:, : mla.kv_lora_rank]).view(context, self.num_heads, -1)
        k_nope, v = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        k_rope = entry[:, None, mla.kv_lora_rank :].expand(-1, self.num_heads, -1)
        k = torch.cat([k_nope, k_rope], dim=-1)
        q = torch.cat([q_nope, q_rope], dim=-1)
        return chunk_attention(q, k, v, self.scale)


def write_latents(cache: torch.Tensor, slots: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
    """Stores each token's latent | RoPE key entry [T, latent_dim] at its slot; returns the
    entries as the cache gives them back (an FP8 cache: one e4m3 row and one scale per
    token, ``fp8_kv.py``), which the step's own prefill attends to."""
    if not is_fp8_cache(cache):
        cache.view(-1, entry.shape[-1]).index_copy_(0, slots, entry)
        return entry
    packed = pack_kv(entry)
    cache.view(torch.uint8).view(-1, packed.shape[-1]).index_copy_(
        0, slots, packed.view(torch.uint8)
    )
    return unpack_kv(packed, entry.dtype)


def mla_decode(
    query: torch.Tensor,
    latent_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    value_dim: int,
) -> torch.Tensor:
    """Absorbed MLA decode, the torch reference: query [B, H, latent_dim] over each row's
    cached latents [C, latent_dim] (cache [blocks, block_size, 1, latent_dim]), values their
    first ``value_dim`` (the latent without its RoPE part) -> [B, H, value_dim]."""
    context = read_context(latent_cache, block_tables, query.dtype)[:, :, 0]
    valid = torch.arange(context.shape[1], device=query.device)[None, :] < context_lens[:, None]
    out = F.scaled_dot_product_attention(
        query[:, None],
        context[:, None],
        context[:, None, :, :value_dim],
        attn_mask=valid[:, None, None, :],
        scale=scale,
    )
    return out[:, 0]


def deinterleave_rope(weight: torch.Tensor, head_dim: int, rope_dim: int) -> torch.Tensor:
    """Rows of a projection whose every ``head_dim`` rows end with ``rope_dim`` RoPE rows in
    (even, odd) pairs -> the same rows with each head's RoPE part in rotate-half order (the
    evens, then the odds)."""
    heads = weight.shape[0] // head_dim
    rows = weight.reshape(heads, head_dim, *weight.shape[1:])
    rope = rows[:, head_dim - rope_dim :]
    reordered = torch.cat([rope[:, 0::2], rope[:, 1::2]], dim=1)
    return torch.cat([rows[:, : head_dim - rope_dim], reordered], dim=1).reshape(weight.shape)


def rope_layout(mla: MLAConfig, projection: str, weight: torch.Tensor) -> torch.Tensor:
    """A checkpoint's q_proj / q_b_proj / kv_a_proj_with_mqa weight with its RoPE rows in the
    engine's order (unchanged where the checkpoint is not interleaved)."""
    if not mla.rope_interleave:
        return weight
    if projection in ("q_proj", "q_b_proj"):
        return deinterleave_rope(weight, mla.qk_head_dim, mla.qk_rope_head_dim)
    if projection == "kv_a_proj_with_mqa":
        return deinterleave_rope(weight, mla.latent_dim, mla.qk_rope_head_dim)
    return weight
