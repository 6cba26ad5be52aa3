"""Qwen3-MoE: Mixtral's layout with an RMSNorm over each query and key head before rotary,
the router's renormalization optional (``norm_topk_prob``), and dense MLP layers where the
config says (``mlp_only_layers``, ``decoder_sparse_step``)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionBackend
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from splitserve.engine.models.mixtral import MixtralForCausalLM, moe


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


class Qwen3MoeForCausalLM(MixtralForCausalLM):
    expert_block = "mlp"
    expert_projections: ClassVar[dict[str, tuple[str, int]]] = {
        "gate_proj": ("w13", 0),
        "up_proj": ("w13", 1),
        "down_proj": ("w2", 0),
    }

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        config = moe(cfg)
        if index in config.dense_layers:
            attention = self.build_attention(cfg, backend)
            return LlamaDecoderLayer(cfg, backend, attention, LlamaMLP(cfg))
        return super().build_layer(cfg, backend, index)

    def build_attention(self, cfg: ModelConfig, backend: AttentionBackend) -> LlamaAttention:
        return Qwen3Attention(cfg, backend) if cfg.qk_norm else LlamaAttention(cfg, backend)
