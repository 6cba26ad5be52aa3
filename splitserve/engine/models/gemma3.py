"""Gemma 3 (``Gemma3ForCausalLM``, text): local sliding-window layers between global ones
(``engine/local_attention.py``), each kind with its own rotary base; Qwen3's q/k norms;
norms before and after both attention and MLP; a GeGLU MLP (tanh GELU); the embeddings
scaled by sqrt(hidden); the softmax scaled by ``query_pre_attn_scalar`` ** -0.5; optional
final logit softcapping; tied embeddings.

Gemma's RMSNorm multiplies by (1 + weight): the checkpoint's norm weights are loaded plus one
(in float32, as transformers adds them), and every norm is then the plain RMSNorm with its
fused kernels. The local layers keep only their window in a KV cache group of their own
(``kv_cache_groups``). On the CPU, steps of decode tokens run the whole stack in one native
call (``layers/native_decode.py``: windows, q/k norms, post-norms and GeGLU included).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.layers.activation import gelu_tanh_and_mul
from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.linear import dense, linear, norm_linear
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.engine.local_attention import LocalAttention
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from splitserve.engine.models.qwen3 import Qwen3Attention


class GeGLU(LlamaMLP):
    activation = "gelu_tanh"

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (down(gelu_tanh(gate) * up) of norm(x + residual), x + residual)."""
        gate_up, residual = norm_linear(x, residual, norm, self.gate_up_proj)
        return linear(gelu_tanh_and_mul(gate_up), self.down_proj), residual


class Gemma3DecoderLayer(LlamaDecoderLayer):
    """``rotary``: this layer's own (the local layers'); None takes the model's (global)."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding | None
    ) -> None:
        super().__init__(cfg, backend, Qwen3Attention(cfg, backend), GeGLU(cfg))
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = rotary

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        own = self.rotary or rotary
        h, residual = self.self_attn(x, residual, self.input_layernorm, positions, own, meta)
        h = self.post_attention_layernorm(h)
        h, residual = self.mlp(h, residual, self.pre_feedforward_layernorm)
        return self.post_feedforward_layernorm(h), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, backend: AttentionBackend) -> None:
        local = _local(cfg)
        # Read by build_layer, which the base class calls; not modules, so set before it.
        self.global_backend = backend.configured(cfg.attention_scale, None)
        self.local_backend = backend.configured(cfg.attention_scale, local.window)
        super().__init__(cfg, backend)
        self.local_rotary = RotaryEmbedding(
            cfg.head_dim, cfg.max_position_embeddings, local.rope_theta, None
        )
        for index in local.layers:
            self.layers[index].rotary = self.local_rotary
        scale = torch.tensor(cfg.hidden_size**0.5, dtype=torch.float32)
        self.register_buffer("embed_scale", scale, persistent=False)

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        local = index in _local(cfg).layers
        return Gemma3DecoderLayer(cfg, self.local_backend if local else self.global_backend, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if image_embeds is not None:
            raise ValueError("Gemma3ForCausalLM reads text only")
        x = self.embed_tokens(input_ids)
        x, residual = x * self.embed_scale.to(x.dtype), None
        if self.native_decode is not None and self.native_decode.takes(x, meta):
            x, residual = self.native_decode.run(x, positions, meta)
        else:
            for layer in self.layers:
                x, residual = layer(x, residual, positions, self.rotary, meta)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def kv_cache_groups(self) -> list[KVCacheGroup]:
        """The global layers (group 0, whose blocks prefix caching keeps), then the local
        layers, which hold only their window (engine/hybrid_blocks.py)."""
        cfg, local = self.config, _local(self.config)
        kinds = [tuple(i for i in range(cfg.num_layers) if i not in local.layers), local.layers]
        spec = [KVCacheSpec(2, len(layers), cfg.num_kv_heads, cfg.head_dim) for layers in kinds]
        return [
            KVCacheGroup(spec[0], kinds[0]),
            KVCacheGroup(spec[1], kinds[1], local.window),
        ]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = dense(hidden, self.lm_head).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else cap * torch.tanh(logits / cap)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Hugging Face tensors, Gemma's norm weights w stored as 1 + w."""
        super().load_weights(
            (name, tensor.float() + 1 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )


def _local(cfg: ModelConfig) -> LocalAttention:
    if cfg.local_attention is None:
        raise ValueError("gemma3_text needs its local layers' window (local_attention)")
    return cfg.local_attention
