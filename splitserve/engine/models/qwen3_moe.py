"""Qwen3-MoE: Mixtral's layout with an RMSNorm over each query and key head before rotary,
the router's renormalization optional (``norm_topk_prob``), and dense MLP layers where the
config says (``mlp_only_layers``, ``decoder_sparse_step``)."""

from __future__ import annotations

from typing import ClassVar

from torch import nn

from splitserve.engine.layers.attention import AttentionBackend
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP
from splitserve.engine.models.mixtral import MixtralForCausalLM, moe
from splitserve.engine.models.qwen3 import Qwen3Attention


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
