"""DeepSeek-V4 (``deepseek_v4``): compressed sparse attention (``layers/v4_attention.py``),
hyper-connections (``layers/hyper_connections.py``) and V4's MoE (``layers/v4_moe.py``).

The token's embedding starts ``hc_mult`` identical residual streams; each layer collapses
them into its attention's input and spreads the output back, then the same around the MoE
MLP; the head collapses them once more before the final norm. Every layer's MLP is routed:
the first ones by token id (``hash_moe``), the others by their scores.

The KV cache (``layers/v4_cache.py``): the compressed entries in group 0, which prefix caching
keeps; every layer's keys, and the compressors' projections of the tokens not pooled yet, in
sliding-window groups, freed behind what a step reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import ClassVar

import torch
from torch import nn

from splitserve.engine.kv_cache_spec import KVCacheGroup, KVCacheSpec
from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata, TorchAttention
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.hyper_connections import HyperConnection, HyperHead, spread
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.layers.rotary import RotaryEmbedding
from splitserve.engine.layers.v4_attention import CacheSlice, V4Attention
from splitserve.engine.layers.v4_cache import cache_groups, single_spec
from splitserve.engine.layers.v4_moe import V4MoE
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.deepseek_v4_names import module_weights
from splitserve.engine.models.mixtral import MixtralForCausalLM, moe
from splitserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from splitserve.engine.v4_config import V4Config
from splitserve.kernels.dispatch import use_kernels

_INDEXER_COMPRESSOR = ("kv_proj", "gate_proj", "position_bias", "kv_norm")


class V4DecoderLayer(nn.Module):
    def __init__(
        self, cfg: ModelConfig, index: int, ep: ExpertParallel | None, kernel: bool = False
    ) -> None:
        super().__init__()
        v4 = v4_config(cfg)
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_hc = HyperConnection(hidden, v4.hc_mult, v4.hc_iters, v4.hc_eps, eps)
        self.ffn_hc = HyperConnection(hidden, v4.hc_mult, v4.hc_iters, v4.hc_eps, eps)
        self.input_layernorm = RMSNorm(hidden, eps)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.self_attn = V4Attention(cfg, v4.layer_kinds[index], kernel)
        config = moe(cfg)
        hashed = index in config.hash_layers
        self.mlp = V4MoE(hidden, config, hashed, cfg.vocab_size, ep)

    def forward(
        self,
        streams: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The residual streams [T, n, H] after this layer."""
        post, comb, h = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(h), positions, meta)
        streams = spread(streams, out, post, comb)
        post, comb, h = self.ffn_hc(streams)
        out = self.mlp.experts_of(self.post_attention_layernorm(h), token_ids)
        return spread(streams, out, post, comb)


class DeepseekV4ForCausalLM(MixtralForCausalLM):
    window_graphs = True
    mtp_architecture = "deepseek_v4_mtp"
    keep_hidden_states = False
    """Keep each step's residual streams [T, n, H] before the head's collapse in
    ``hidden_states`` (the MTP drafter reads them, ``engine/spec/mtp.py``)."""
    expert_block = "mlp"
    expert_projections: ClassVar[dict[str, tuple[str, int]]] = (
        Qwen3MoeForCausalLM.expert_projections  # the same per-expert names
    )

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, ep: ExpertParallel | None = None
    ) -> None:
        super().__init__(cfg, backend, ep)
        v4 = v4_config(cfg)
        self.hc_head = HyperHead(cfg.hidden_size, v4.hc_mult, v4.hc_eps, cfg.rms_norm_eps)
        self.streams = v4.hc_mult
        self.graph_safe = uses_kernels(backend) and use_kernels(self.embed_tokens.weight)
        """A decode step reads nothing on the host where its attention's decode rows take
        the kernels (the "triton" backend on CUDA): they pool the windows they close and
        attend in fixed shapes (``V4Attention.pool_decodes``). The torch path walks the
        step's queries on the host."""

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return V4DecoderLayer(cfg, index, self.ep, uses_kernels(backend))

    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        """No tables: V4's attention rotates by its own interleaved rope at each call."""
        return RotaryEmbedding(v4_config(cfg).rope_dim, 0, cfg.rope_theta, None)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        streams = x.unsqueeze(1).expand(-1, self.streams, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, positions, meta)
        if self.keep_hidden_states:
            self.hidden_states = streams
        return self.norm(self.hc_head(streams))

    def v4_attention(self) -> list[V4Attention]:
        return [m for m in self.modules() if isinstance(m, V4Attention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        """Every layer in one group (``hybrid_kv_cache: false``, the MTP drafter's engine):
        a layer's window row then its entry pieces."""
        return single_spec(self._v4_layers())

    def kv_cache_groups(self) -> list[KVCacheGroup]:
        return cache_groups(self._v4_layers())

    def _v4_layers(self) -> V4Config:
        """The config of the layers built here (the MTP block's kind for its model)."""
        v4 = v4_config(self.config)
        kinds = tuple(attn.kind for attn in self.v4_attention())
        return dataclasses.replace(v4, layer_kinds=kinds)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for index, attn in enumerate(self.v4_attention()):
            layer, layout = kv_cache[0, index], attn.layout
            state = CacheSlice(layer, 0, layout.key)
            entries = CacheSlice(layer, 0, layout.key + layout.state_width)
            attn.bind(CacheSlice(layer, 0), state, entries)

    def bind_kv_groups(self, caches: list[torch.Tensor], groups: list[KVCacheGroup]) -> None:
        """Group 0's one row holds the compressed layers' pieces in layer order, group 1
        every layer's key, the others the state rows of a kind's layers."""
        layers = self.v4_attention()
        column, entries = 0, {}
        for layer in groups[0].layers:
            entries[layer] = CacheSlice(caches[0][0, 0], 0, column)
            column += layers[layer].layout.piece
        state = {
            layer: CacheSlice(caches[index][0, position], index)
            for index, group in enumerate(groups[2:], start=2)
            for position, layer in enumerate(group.layers)
        }
        for position, layer in enumerate(groups[1].layers):
            keys = CacheSlice(caches[1][0, position], 1)
            layers[layer].bind(keys, state.get(layer, keys), entries.get(layer, keys))

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]:
        """transformers' module names (``module_weights``) -> ours: the indexer beside the
        compressor, the shared experts' gate | up fused, the router's table and bias on the
        MoE module; the routed experts as Mixtral's."""
        parts = hf_name.split(".")
        if parts[0] != "layers":
            return [(hf_name, 0)]
        prefix, inner = ".".join(parts[:3]), parts[3:]
        if inner[:2] == ["compressor", "indexer"]:
            where = "indexer.compressor" if inner[2] in _INDEXER_COMPRESSOR else "indexer"
            return [(f"{prefix}.{where}.{'.'.join(inner[2:])}", 0)]
        if inner[0] == "shared_experts" and inner[1] in ("gate_proj", "up_proj"):
            rows = moe(self.config).shared_intermediate_size if inner[1] == "up_proj" else 0
            return [(f"{prefix}.shared_experts.gate_up_proj.{inner[-1]}", rows)]
        if inner[:2] in (["gate", "tid2eid"], ["gate", "e_score_correction_bias"]):
            return [(f"{prefix}.{inner[1]}", 0)]
        if inner[0] in ("gate", "experts"):
            return super().weight_targets(f"model.{hf_name}")
        return [(hf_name, 0)]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(module_weights(weights))


def uses_kernels(backend: AttentionBackend) -> bool:
    """The "triton" backend: the attention's CUDA decode rows take the kernels."""
    return not isinstance(backend, TorchAttention)


def v4_config(cfg: ModelConfig) -> V4Config:
    if cfg.v4 is None:
        raise ValueError(f"{cfg.architecture} needs DeepSeek-V4's config (layer_types, ...)")
    return cfg.v4
