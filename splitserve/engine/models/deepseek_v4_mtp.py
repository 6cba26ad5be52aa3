"""DeepSeek-V4's multi-token-prediction block as a model of its own (the MTP drafter's,
``engine/spec/mtp.py``).

transformers' V4 has no MTP module (it drops ``mtp.*`` on load); the layout here follows
DeepSeek's release, which ships the block as ``mtp.0.*`` in its own tensor names. At position
i the block reads token i + 1 and the target's residual streams at i ([n, H], before the
head's collapse): the token's embedding, RMS-normed (``enorm``) and projected (``e_proj``), is
added to every stream, each stream RMS-normed (``hnorm``) and projected (``h_proj``). One V4
decoder block (hyper-connections around V4 attention and MoE, with a cache of its own), a
collapse of the streams by the block's own head weights (``hc_head_fn`` / ``_base`` /
``_scale``), its own final norm (``norm``) and the target's LM head predict token i + 2. Its
output streams stand in for the target's when drafts are chained.

The block's attention kind is ``V4Config.mtp_kind``; its MoE routes by scores (it sits past
the hashed layers). The embedding and head are the target's (``embed``, ``head``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from splitserve.engine.layers.attention import AttentionBackend, AttentionMetadata
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.norm import RMSNorm
from splitserve.engine.model_config import ModelConfig
from splitserve.engine.models.deepseek_v4 import (
    DeepseekV4ForCausalLM,
    V4DecoderLayer,
    uses_kernels,
    v4_config,
)
from splitserve.engine.models.deepseek_v4_names import module_name

_OWN = ("enorm", "hnorm", "e_proj", "h_proj", "norm")
_SHARED = ("embed_tokens.weight", "lm_head.weight")


class DeepseekV4MTP(DeepseekV4ForCausalLM):
    """Built from the target's config (``architecture: deepseek_v4_mtp``); ``layers`` holds
    the one block. Before each step the drafter sets ``previous_hidden`` [T, n, H], one row
    per input row; after it ``hidden_states`` holds the block's output streams."""

    def __init__(
        self, cfg: ModelConfig, backend: AttentionBackend, ep: ExpertParallel | None = None
    ) -> None:
        v4 = v4_config(cfg)
        self.mtp_index = cfg.num_layers  # read by build_layer, which the base class calls
        kinds = (*v4.layer_kinds, v4.mtp_kind)
        self.block_config = dataclasses.replace(cfg, v4=dataclasses.replace(v4, layer_kinds=kinds))
        one = dataclasses.replace(v4, layer_kinds=(v4.mtp_kind,))
        super().__init__(dataclasses.replace(cfg, num_layers=1, v4=one), backend, ep)
        hidden = cfg.hidden_size
        self.enorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(hidden, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.previous_hidden = torch.empty(0)
        self.hidden_states = torch.empty(0)

    def build_layer(self, cfg: ModelConfig, backend: AttentionBackend, index: int) -> nn.Module:
        return V4DecoderLayer(self.block_config, self.mtp_index, self.ep, uses_kernels(backend))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        image_embeds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        embeds = dense(self.enorm(self.embed_tokens(input_ids)), self.e_proj)
        previous = self.previous_hidden.to(embeds.dtype)
        normed = self.hnorm(previous.flatten(0, 1)).view_as(previous)
        streams = dense(normed, self.h_proj) + embeds.unsqueeze(1)
        self.hidden_states = self.layers[0](streams, input_ids, positions, meta)
        return self.norm(self.hc_head(self.hidden_states))

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        found: list[str] = []
        try:
            super().load_weights(_mtp_weights(weights, found))
        except ValueError:
            if found:
                raise
            raise ValueError(
                "speculative method mtp needs a model with an MTP layer: the checkpoint has "
                "no mtp.0.* tensors (transformers' V4 writes none)"
            ) from None


def _mtp_weights(
    weights: Iterable[tuple[str, torch.Tensor]], found: list[str]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The first MTP block's tensors (their names added to found), its block's as layer 0's
    and its own at the top (where ``module_weights`` takes them), and the target's embedding
    and head; nothing else."""
    for name, tensor in weights:
        bare = name.removeprefix("model.")
        if bare.startswith("mtp.0."):
            found.append(name)
            rest = bare.removeprefix("mtp.0.")
            own = rest.split(".")[0] in _OWN or rest.startswith("hc_head_")
            yield (rest if own else f"layers.0.{rest}"), tensor
        elif bare.split(".")[0] != "mtp" and module_name(name) in _SHARED:
            yield name, tensor
