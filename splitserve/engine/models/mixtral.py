"""Mixtral: Llama's attention with a mixture-of-experts MLP in every layer
(``layers/moe.py``: softmax top-k router, renormalized; SwiGLU experts).

Each layer's experts are two stacked parameters, ``w13`` [E, 2 * I, H] (gate | up) and ``w2``
[E, H, I]; ``weight_targets`` maps the checkpoint's per-expert tensors onto their rows.
Qwen3-MoE (``qwen3_moe.py``) derives from this class.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionBackend
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.moe import SparseMoE
from splitserve.engine.model_config import ModelConfig, MoEConfig
from splitserve.engine.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    """``ep``: this rank's share of an expert-parallel group (``layers/expert_placement.py``);
    its MoE layers then hold only the experts of its slots."""

    expert_block = "block_sparse_moe"
    """The MoE MLP's module name in the checkpoint (``model.layers.N.<expert_block>.gate``)."""
    expert_projections: ClassVar[dict[str, tuple[str, int]]] = {
        "w1": ("w13", 0),
        "w3": ("w13", 1),
        "w2": ("w2", 0),
    }
    """Per-expert tensor -> (our stacked parameter, its slice: 0 gate or down, 1 up)."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, ep: ExpertParallel | None = None
    ) -> None:
        self.ep = ep  # read by build_layer, which the base class calls
        super().__init__(cfg, backend)

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        experts = SparseMoE(cfg.hidden_size, moe(cfg), self.ep)
        return LlamaDecoderLayer(cfg, backend, self.build_attention(cfg, backend), experts)

    def build_attention(self, cfg: ModelConfig, backend: AttentionBackend) -> LlamaAttention:
        return LlamaAttention(cfg, backend)

    def moe_layers(self) -> list[SparseMoE]:
        return [m for m in self.modules() if isinstance(m, SparseMoE)]

    def expert_load(self) -> torch.Tensor:
        """[MoE layers, E] int64: (token, slot) pairs routed to each expert since the last
        ``reset_expert_load``."""
        return torch.stack([layer.expert_load for layer in self.moe_layers()])

    def reset_expert_load(self) -> None:
        for layer in self.moe_layers():
            layer.expert_load.zero_()

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]:
        parts = hf_name.removeprefix("model.").split(".")
        if len(parts) < 4 or parts[2] != self.expert_block or parts[3] not in ("gate", "experts"):
            return super().weight_targets(hf_name)
        prefix = f"layers.{parts[1]}.mlp"
        if parts[3] != "experts":
            return [(f"{prefix}.{'.'.join(parts[3:])}", 0)]
        expert, (target, index) = int(parts[4]), self.expert_projections[parts[5]]
        cfg = moe(self.config)
        rows = 2 * cfg.intermediate_size if target == "w13" else self.config.hidden_size
        return [
            (f"{prefix}.{target}", slot * rows + index * cfg.intermediate_size)
            for slot in self.expert_slots(expert)
        ]

    def expert_slots(self, expert: int) -> list[int]:
        """This model's slots (of each MoE layer's stacked experts) that hold ``expert``."""
        if self.ep is None:
            return [expert]
        return [slot for slot, held in enumerate(self.ep.local_slots) if held == expert]

    def required_rows(self, name: str, param: torch.Tensor) -> int:
        rows = super().required_rows(name, param)
        if self.ep is None or not name.endswith((".w13", ".w2")):
            return rows
        held = sum(expert >= 0 for expert in self.ep.local_slots)
        return rows // self.ep.width * held

    def idle_step(self) -> None:
        """An expert-parallel rank with nothing to compute joins its group's MoE exchanges."""
        for layer in self.moe_layers():
            layer.idle()


def moe(cfg: ModelConfig) -> MoEConfig:
    if cfg.moe is None:
        raise ValueError(f"{cfg.architecture} needs an MoE config (num_experts, top_k)")
    return cfg.moe
