"""Qwen3 (dense): Llama's layout with an RMSNorm over each query and key head before rotary,
no q/k/v bias. Qwen3-MoE (``qwen3_moe.py``) and Gemma 3 (``gemma3.py``) take its attention."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionBackend
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__(cfg, backend)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def project_qkv(
        self, x: torch.Tensor, residual: torch.Tensor | None, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        qkv, residual = super().project_qkv(x, residual, norm)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        tokens = qkv.shape[0]
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(tokens, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(tokens, self.kv_size)
        return torch.cat([q, k, v], dim=-1), residual


class Qwen3ForCausalLM(LlamaForCausalLM):
    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, backend, Qwen3Attention(cfg, backend))
