"""Where each expert's copies live in an expert-parallel group: the ``Placement`` table that
EPLB computes (``eplb/rebalance.py``), the engine dispatches by
(``engine/layers/expert_placement.py``) and the simulator replays (``eplb/simulate.py``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    """One MoE layer's experts on the ranks of an expert-parallel group."""

    slots: torch.Tensor
    """[ranks, slots per rank] int64: the logical expert in each physical slot, -1 if empty."""
    shares: torch.Tensor
    """[ranks, slots per rank] float64: the fraction of its expert's tokens each slot serves
    (an expert's shares sum to 1; 0 in empty slots)."""

    @property
    def num_ranks(self) -> int:
        return self.slots.shape[0]

    def replicas(self, num_experts: int) -> torch.Tensor:
        """[experts]: how many copies each expert has."""
        held = self.slots[self.slots >= 0]
        return torch.bincount(held, minlength=num_experts)

    def rank_loads(self, load: torch.Tensor) -> torch.Tensor:
        """[ranks] float64: each rank's part of ``load`` [experts] (or [steps, experts] ->
        [steps, ranks])."""
        padded = torch.cat(
            [load.double(), torch.zeros_like(load[..., :1], dtype=torch.float64)], -1
        )
        return (padded[..., self.slots] * self.shares).sum(dim=-1)

    @classmethod
    def even(cls, slots: torch.Tensor, num_experts: int) -> Placement:
        """Each expert's tokens split evenly over its copies."""
        copies = torch.bincount(slots[slots >= 0], minlength=num_experts).double()
        padded = torch.cat([1 / copies.clamp(min=1), torch.zeros(1, dtype=torch.float64)])
        return cls(slots, padded[slots])


def imbalance(rank_loads: torch.Tensor) -> float:
    """max / mean of the ranks' loads (1.0 is perfect; 1.0 for no load at all)."""
    mean = float(rank_loads.double().mean())
    return float(rank_loads.max()) / mean if mean > 0 else 1.0


def static_placement(num_experts: int, num_ranks: int) -> Placement:
    """No EPLB: expert e on rank e // (experts per rank), no copies."""
    if num_experts % num_ranks:
        raise ValueError(f"{num_experts} experts do not divide over {num_ranks} ranks")
    return Placement.even(torch.arange(num_experts).view(num_ranks, -1), num_experts)
