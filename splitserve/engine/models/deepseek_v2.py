"""DeepSeek-V2, V2-Lite, V3, R1 and V3.1: multi-head latent attention (``layers/mla.py``)
and DeepSeekMoE (``layers/deepseek_moe.py``) in Llama's decoder layer.

The first ``first_k_dense_replace`` layers keep a dense SwiGLU MLP; the others route to
experts stacked like Mixtral's (``w13``, ``w2``) beside their shared experts. The KV cache
holds one latent per token and layer (``kv_cache_spec``). Tensors of the layers past the last
decoder layer (V3's multi-token-prediction layer) are not this model's: the MTP drafter loads
them (``engine/spec/mtp.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import ClassVar

import torch
from torch import nn

from splitserve.engine.kv_cache_spec import KVCacheSpec
from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.deepseek_moe import DeepseekMoE
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.mla import MLAAttention, rope_layout
from splitserve.engine.model_config import MLAConfig, ModelConfig
from splitserve.engine.models.llama import LlamaDecoderLayer, LlamaMLP
from splitserve.engine.models.mixtral import MixtralForCausalLM, moe
from splitserve.engine.models.qwen3_moe import Qwen3MoeForCausalLM
from splitserve.kernels.fp8_quant import BLOCK, FP8

_IN_PROJ = ("q_a_proj", "q_proj", "kv_a_proj_with_mqa")
_SHARED = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class DeepseekV2ForCausalLM(MixtralForCausalLM):
    expert_block = "mlp"
    expert_projections: ClassVar[dict[str, tuple[str, int]]] = (
        Qwen3MoeForCausalLM.expert_projections  # the same per-expert names
    )

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, ep: ExpertParallel | None = None
    ) -> None:
        super().__init__(cfg, backend, ep)
        self.mla = mla_config(cfg)

    mtp_architecture = "deepseek_mtp"
    keep_hidden_states = False
    """Keep each step's final hidden states in ``hidden_states`` (the MTP drafter reads them,
    ``engine/spec/mtp.py``)."""

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return deepseek_layer(cfg, backend, index, self.ep)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        hidden = super().forward(input_ids, positions, meta, image_embeds)
        if self.keep_hidden_states:
            self.hidden_states = hidden
        return hidden

    def mla_layers(self) -> list[MLAAttention]:
        return [m for m in self.modules() if isinstance(m, MLAAttention)]

    def kv_cache_spec(self) -> KVCacheSpec:
        """One latent (and its RoPE key) per token and layer."""
        return KVCacheSpec(1, len(self.mla_layers()), 1, self.mla.latent_dim)

    def bind_kv_cache(self, kv_cache: torch.Tensor) -> None:
        for index, attn in enumerate(self.mla_layers()):
            attn.latent_cache = kv_cache[0, index]

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]:
        parts = hf_name.removeprefix("model.").split(".")
        if parts[0] == "layers" and int(parts[1]) >= self.config.num_layers:
            return []  # an MTP layer's
        return self.layer_targets(parts) or super().weight_targets(hf_name)

    def layer_targets(self, parts: list[str]) -> list[tuple[str, int]]:
        """The names that differ from Mixtral's: MLA's fused first projection, the shared
        experts' fused gate | up, the router's bias (none for any other name)."""
        if len(parts) < 5 or parts[0] != "layers":
            return []
        prefix = ".".join(parts[:3])
        if parts[2] == "self_attn" and parts[3] in _IN_PROJ:
            q_size = self.mla.q_lora_rank or self.config.num_heads * self.mla.qk_head_dim
            offset = q_size if parts[3] == "kv_a_proj_with_mqa" else 0
            return [(f"{prefix}.in_proj.{parts[-1]}", offset)]
        if parts[3] == "shared_experts" and parts[4] in _SHARED:
            target, index = _SHARED[parts[4]]
            rows = moe(self.config).shared_intermediate_size
            return [(f"{prefix}.shared_experts.{target}.{parts[-1]}", index * rows)]
        if parts[3] == "gate" and parts[4] == "e_score_correction_bias":
            return [(f"{prefix}.e_score_correction_bias", 0)]
        return []

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(rope_reordered(weights, self.mla))


def mla_config(cfg: ModelConfig) -> MLAConfig:
    if cfg.mla is None:
        raise ValueError(f"{cfg.architecture} needs an MLA config (kv_lora_rank, ...)")
    return cfg.mla


def deepseek_layer(
    cfg: ModelConfig, backend: AttentionBackend, index: int, ep: ExpertParallel | None
) -> LlamaDecoderLayer:
    """Decoder layer ``index``: MLA, then a dense MLP or DeepSeekMoE."""
    config = moe(cfg)
    mlp: nn.Module
    if index in config.dense_layers:
        mlp = LlamaMLP(cfg)
    else:
        mlp = DeepseekMoE(cfg.hidden_size, config, ep)
    return LlamaDecoderLayer(cfg, backend, MLAAttention(cfg, backend), mlp)


def rope_reordered(
    weights: Iterable[tuple[str, torch.Tensor]], mla: MLAConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with the RoPE rows of its query and latent projections in
    the engine's rotate-half order (``layers/mla.py``). FP8 blocks kept as they are
    (``quantization="fp8"``) keep their scales: their rows may only move inside a block."""
    for name, tensor in weights:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight":
            if tensor.dtype == FP8 and not _inside_blocks(mla, parts[-2], tensor.shape[0]):
                raise ValueError(f"{name}: its RoPE rows move across FP8 blocks")
            tensor = rope_layout(mla, parts[-2], tensor)
        yield name, tensor


def _inside_blocks(mla: MLAConfig, projection: str, rows: int) -> bool:
    index = torch.arange(rows)[:, None]
    return bool((rope_layout(mla, projection, index)[:, 0] // BLOCK == index[:, 0] // BLOCK).all())
