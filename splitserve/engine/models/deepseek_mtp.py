"""DeepSeek-V3's multi-token-prediction layer as a model of its own (the MTP drafter's,
``engine/spec/mtp.py``).

The checkpoint ships it as layer ``num_hidden_layers`` (``model.layers.61`` in V3): at position
i it takes the embedding of token i + 1 and the target's hidden state at i, each RMS-normed
(``enorm``, ``hnorm``), concatenated in that order and projected back to the hidden size
(``eh_proj``); one decoder block (MLA and DeepSeekMoE, with a latent cache of its own) and the
shared head (``shared_head.norm``, then the target's LM head) predict token i + 2. Its output
hidden state, before that norm, stands in for the target's when drafts are chained.

The embedding and head are the target's tensors (``model.embed_tokens``, ``lm_head``), which
the layer's own copies in V3's checkpoint equal. The target hidden state is the target model's
final normed output (what its head reads), as vLLM passes it.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.deepseek_v2 import DeepseekV2ForCausalLM, deepseek_layer

_OWN = ("enorm", "hnorm", "eh_proj")


class DeepseekMTP(DeepseekV2ForCausalLM):
    """Built from the target's config (``architecture: deepseek_mtp``); ``layers`` holds the
    MTP's one decoder block. Before each step the drafter sets ``previous_hidden`` [T, H],
    one row per input row; after it ``hidden_states`` holds the block's output rows."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, ep: ExpertParallel | None = None
    ) -> None:
        self.mtp_index = cfg.num_layers  # read by build_layer, which the base class calls
        super().__init__(dataclasses.replace(cfg, num_layers=1), backend, ep)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.previous_hidden = torch.empty(0)
        self.hidden_states = torch.empty(0)

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return deepseek_layer(cfg, backend, self.mtp_index, self.ep)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        embeds = self.enorm(self.embed_tokens(input_ids))
        joined = torch.cat([embeds, self.hnorm(self.previous_hidden.to(embeds.dtype))], dim=-1)
        x, residual = self.layers[0](
            dense(joined, self.eh_proj), None, positions, self.rotary, meta
        )
        self.hidden_states = x + residual
        return self.norm(self.hidden_states)

    def weight_targets(self, hf_name: str) -> list[tuple[str, int]]:
        """The MTP layer's tensors, and the target's embedding and head; nothing else."""
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            return [(hf_name.removeprefix("model."), 0)]
        prefix = f"model.layers.{self.mtp_index}."
        if not hf_name.startswith(prefix):
            return []
        name = hf_name.removeprefix(prefix)
        if name.split(".")[0] in _OWN:
            return [(name, 0)]
        if name.startswith("shared_head.norm."):
            return [(name.removeprefix("shared_head."), 0)]
        if name.startswith(("shared_head.head.", "embed_tokens.")):
            return []  # copies of the target's
        return super().weight_targets(f"model.layers.0.{name}")
