"""DeepSeekMoE: routed experts chosen within the best groups, plus shared experts.

The router scores each expert (V2: softmax; V3: sigmoid, V4: sqrt(softplus), with a learned
per-expert ``e_score_correction_bias`` added for the choice only), keeps the ``topk_groups`` best of
``num_groups`` groups of experts (V2: a group's best score; V3: the sum of its two best),
takes the ``top_k`` best experts inside them, and weighs each by its unbiased score
(renormalized over the chosen where the config says), times ``routed_scaling_factor``.
The shared experts run on every token beside them, and on every rank of an expert-parallel
group (only the routed experts are sharded, ``engine/expert_parallel.py``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.engine.layers.activation import clipped_silu_and_mul, silu_and_mul
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.layers.linear import dense
from splitserve.engine.layers.moe import Routing, SparseMoE
from splitserve.engine.model_config import MoEConfig


def expert_scores(logits: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """Router logits [T, E] -> each expert's score, in float32."""
    logits = logits.float()
    if moe.scoring == "sigmoid":
        return logits.sigmoid()
    if moe.scoring == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    return logits.softmax(dim=-1)


def weigh(scores: torch.Tensor, experts: torch.Tensor, moe: MoEConfig) -> Routing:
    """The chosen experts [T, k] weighed by their scores (renormalized where the config
    says), times ``routed_scaling_factor``."""
    weights = scores.gather(1, experts)
    if moe.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(weights * moe.routed_scaling_factor, experts)


def route_grouped(logits: torch.Tensor, moe: MoEConfig, bias: torch.Tensor | None) -> Routing:
    """DeepSeek's routing of router logits [T, E] (float32 throughout, as transformers)."""
    scores = expert_scores(logits, moe)
    choice = scores if bias is None else scores + bias
    if moe.num_groups > 1:
        grouped = choice.view(choice.shape[0], moe.num_groups, moe.num_experts // moe.num_groups)
        if moe.scoring == "sigmoid":
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        else:
            group_scores = grouped.amax(dim=-1)
        best = group_scores.topk(moe.topk_groups, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), -torch.inf)
    return weigh(scores, choice.topk(moe.top_k, dim=-1).indices, moe)


class RouterGate(nn.Module):
    """The router's projection, held and computed in float32 whatever the model's dtype
    (transformers keeps DeepSeek's gate in float32: a bfloat16 score can flip a choice)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=torch.float32))
        nn.init.normal_(self.weight, std=hidden_size**-0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class SharedExperts(nn.Module):
    """The shared experts as one SwiGLU MLP: gate | up fused, then down; ``limit``: V4's
    clipped SwiGLU."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float | None) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.limit = limit

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate_up = dense(h, self.gate_up_proj)
        if self.limit is None:
            return dense(silu_and_mul(gate_up), self.down_proj)
        return dense(clipped_silu_and_mul(gate_up, self.limit), self.down_proj)


class DeepseekMoE(SparseMoE):
    def __init__(self, hidden_size: int, moe: MoEConfig, ep: ExpertParallel | None = None) -> None:
        super().__init__(hidden_size, moe, ep)
        self.gate = RouterGate(hidden_size, moe.num_experts)  # type: ignore[assignment]
        self.e_score_correction_bias: nn.Parameter | None = None
        if moe.scoring != "softmax":
            bias = torch.zeros(moe.num_experts, dtype=torch.float32)
            self.e_score_correction_bias = nn.Parameter(bias)
        self.shared_experts: SharedExperts | None = None
        if moe.shared_intermediate_size:
            width = moe.shared_intermediate_size
            self.shared_experts = SharedExperts(hidden_size, width, moe.swiglu_limit)

    def route(self, logits: torch.Tensor) -> Routing:
        return route_grouped(logits, self.moe, self.e_score_correction_bias)

    def experts(self, h: torch.Tensor) -> torch.Tensor:
        return self.with_shared(h, super().experts(h))

    def with_shared(self, h: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
        return routed if self.shared_experts is None else routed + self.shared_experts(h)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        limit = self.moe.swiglu_limit
        return super().act(gate_up) if limit is None else clipped_silu_and_mul(gate_up, limit)
