"""A Llama decoder in plain PyTorch with a static KV cache: the model of the compiled peer.

The approach of gpt-fast, written here for the benchmark: each layer owns a KV cache of fixed
shape [batch, kv heads, max_len, head dim] that a step writes in place at its positions, and a
decode step attends over the whole cache with the positions after its own masked out, so every
decode step has the same shapes and addresses and ``torch.compile(mode="reduce-overhead")``
captures it once as a CUDA graph (``compiled_peer.py``). Q/K/V and gate/up are one matmul each.

A prefill starts at position 0 and attends over its own keys (causal SDPA); all rows of a
batch share their positions (prompts of one length, as the offline benchmark sends).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.rotary import inverse_frequencies
from splitserve.engine.model_config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE; x [B, heads, T, D], cos / sin [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = self.q_size + 2 * self.kv_size
        self.wqkv = nn.Linear(cfg.hidden_size, out, bias=cfg.attention_bias)
        self.wo = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def set_cache(self, batch: int, max_len: int) -> None:
        shape = (batch, self.kv_heads, max_len, self.head_dim)
        weight = self.wo.weight
        self.k_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        self.v_cache = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
        # The caches are written in place inside the captured graph: their addresses are fixed.
        torch._dynamo.mark_static_address(self.k_cache)
        torch._dynamo.mark_static_address(self.v_cache)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        batch, length, _ = x.shape
        q, k, v = self.wqkv(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(batch, length, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        self.k_cache.index_copy_(2, pos, k)
        self.v_cache.index_copy_(2, pos, v)
        out = self._prefill(q, k, v) if length > 1 else self._decode(q, pos)
        return self.wo(out.transpose(1, 2).reshape(batch, length, self.q_size))

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _decode(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One query per row against the whole cache; the query heads of a KV head are rows of
        one matmul, so the cache is read once and never copied per head."""
        batch, group = q.shape[0], self.heads // self.kv_heads
        grouped = q.view(batch, self.kv_heads, group, self.head_dim)
        scores = (grouped @ self.k_cache.transpose(-1, -2)).float() * self.head_dim**-0.5
        positions = torch.arange(self.k_cache.shape[2], device=pos.device)
        scores = scores.masked_fill(positions > pos, float("-inf"))
        out = scores.softmax(dim=-1).to(q.dtype) @ self.v_cache
        return out.view(batch, self.heads, 1, self.head_dim)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.w13 = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.w2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor
    ) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin, pos)
        gate, up = self.w13(self.ffn_norm(h)).chunk(2, dim=-1)
        return h + self.w2(F.silu(gate) * up)


class CompiledLlama(nn.Module):
    """Token ids [B, T] at positions ``pos`` [T] -> logits of the last position [B, vocab]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.sliding_window is not None and cfg.sliding_window < cfg.max_position_embeddings:
            raise ValueError("the compiled peer has no sliding-window attention")
        self.config = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.output.weight = self.tok_embeddings.weight
        with torch.device("cpu"):  # whatever device the model is built under
            self.inv_freq = inverse_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.cos = torch.empty(0)
        self.sin = torch.empty(0)
        self.batch, self.max_len = 0, 0

    def set_cache(self, batch: int, max_len: int) -> None:
        """Static KV caches for ``batch`` rows of up to ``max_len`` positions (a new shape
        means a new compiled graph)."""
        weight = self.output.weight
        for block in self.layers:
            cast(Block, block).attention.set_cache(batch, max_len)
        freqs = torch.arange(max_len, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
        angles = torch.cat((freqs, freqs), dim=-1).to(weight.device)
        self.cos, self.sin = angles.cos().to(weight.dtype), angles.sin().to(weight.dtype)
        torch._dynamo.mark_static_address(self.cos)
        torch._dynamo.mark_static_address(self.sin)
        self.batch, self.max_len = batch, max_len

    def forward(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        cos, sin = self.cos[pos], self.sin[pos]
        for layer in self.layers:
            x = layer(x, cos, sin, pos)
        return self.output(self.norm(x[:, -1])).float()

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Tensors under Hugging Face Llama names (``loader.text_weights``) into this layout."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            if hf_name == "model.rope_freqs.weight":  # GGUF Llama 3: per-frequency divisors
                self.inv_freq = self.inv_freq / tensor.float().cpu()
                continue
            if "rotary_emb" in hf_name or (
                hf_name == "lm_head.weight" and self.config.tie_word_embeddings
            ):
                continue
            name, offset = self._target(hf_name)
            rows = tensor.shape[0]
            params[name][offset : offset + rows].copy_(tensor)
            loaded.add(hf_name)
        expected = 3 + 9 * self.config.num_layers - int(self.config.tie_word_embeddings)
        expected += 3 * self.config.num_layers * int(self.config.attention_bias)
        if len(loaded) != expected:
            raise ValueError(f"checkpoint has {len(loaded)} of the {expected} tensors expected")

    def _target(self, hf_name: str) -> tuple[str, int]:
        """A Hugging Face tensor name -> (this model's parameter, first row of its slice)."""
        cfg = self.config
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        ffn = cfg.intermediate_size
        top = {
            "model.embed_tokens.weight": "tok_embeddings.weight",
            "model.norm.weight": "norm.weight",
            "lm_head.weight": "output.weight",
        }
        if hf_name in top:
            return top[hf_name], 0
        _, _, index, module, *rest = hf_name.split(".")
        leaf = rest[-1]
        layer = f"layers.{index}"
        slices = {
            "q_proj": ("attention.wqkv", 0),
            "k_proj": ("attention.wqkv", q),
            "v_proj": ("attention.wqkv", q + kv),
            "o_proj": ("attention.wo", 0),
            "gate_proj": ("w13", 0),
            "up_proj": ("w13", ffn),
            "down_proj": ("w2", 0),
        }
        if module == "input_layernorm":
            return f"{layer}.attention_norm.{leaf}", 0
        if module == "post_attention_layernorm":
            return f"{layer}.ffn_norm.{leaf}", 0
        target, offset = slices[rest[0]]
        return f"{layer}.{target}.{leaf}", offset
