"""DeepSeek-V4's MoE MLP: DeepSeekMoE with sqrt(softplus) scores, a clipped SwiGLU in the routed
and shared experts, and, in its first layers, experts fixed per token id.

A hash layer's ``tid2eid`` [vocab, top_k] names each token's experts; the router's scores
only weigh them (renormalized, times ``routed_scaling_factor``, as the top-k layers').
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.layers.deepseek_moe import DeepseekMoE, expert_scores, weigh
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.moe import Routing
from splitserve.engine.model_config import MoEConfig


class V4MoE(DeepseekMoE):
    def __init__(
        self,
        hidden_size: int,
        moe: MoEConfig,
        hashed: bool,
        vocab_size: int,
        ep: ExpertParallel | None = None,
    ) -> None:
        super().__init__(hidden_size, moe, ep)
        self.tid2eid: nn.Parameter | None = None
        if hashed:
            self.e_score_correction_bias = None
            # A checkpoint's table replaces it; random weights (shapes) spread tokens evenly.
            table = torch.arange(vocab_size)[:, None] * moe.top_k + torch.arange(moe.top_k)
            table = table % moe.num_experts
            self.tid2eid = nn.Parameter(table, requires_grad=False)

    def experts_of(self, h: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """The MLP of normed tokens h [T, H] whose ids are token_ids [T]."""
        logits = dense(h, self.gate) if h.shape[0] else h.new_empty((0, self.moe.num_experts))
        return self.with_shared(h, self.routed_experts(h, self.route_tokens(logits, token_ids)))

    def route_tokens(self, logits: torch.Tensor, token_ids: torch.Tensor) -> Routing:
        if self.tid2eid is None:
            return self.route(logits)
        return weigh(expert_scores(logits, self.moe), self.tid2eid[token_ids], self.moe)
