"""The EPLB simulator: replays an expert-load trace on an expert-parallel group, with and
without rebalancing, and models the decode step time from per-rank loads.

Every ``interval_steps`` steps the rebalancer (``placement.rebalance``) computes a placement
from the interval just ended, and the next interval runs on it (the first runs on the static
placement, as a group does before it has counted anything, and is left out of the averages
of both runs unless it is the only one). Reported per layer and averaged:

- interval imbalance: max / mean of the ranks' loads summed over an interval (what EPLB
  balances: the expected load; intervals after the first);
- step imbalance: the same per step (at small batches sampling noise dominates it);
- modelled step time of the MoE part of a decode step (``StepCosts``): the ranks wait for the
  slowest one (lockstep), whose expert GEMMs take a fixed time, read each expert it serves
  once and take time per row, plus a dispatch and a combine all-to-all sized by the busiest
  rank's rows.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

import torch

from splitserve.eplb.placement import Placement, imbalance, static_placement
from splitserve.eplb.rebalance import rebalance


@dataclass(frozen=True)
class StepCosts:
    """Cost constants, in microseconds and bytes. The defaults are not measured: they are
    DeepSeek-V3-like experts (7168 x 2048, 3 matrices, FP8) on the design card's H200
    bandwidth (4.24 TB/s) and a 50 GB/s per-GPU network with 20 us per all-to-all.
    ``from_gemm_measurement`` and ``from_a2a_measurement`` take the expert GEMM's and the
    all-to-all's constants from measurements."""

    expert_bytes: float = 3 * 7168 * 2048
    hbm_bytes_per_us: float = 4.24e6
    us_per_row: float = 0.01
    row_bytes: float = 7168 * 2
    link_bytes_per_us: float = 5.0e4
    a2a_latency_us: float = 20.0
    gemm_fixed_us: float = 0.0

    def step_us(self, rows: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
        """rows, active: [..., ranks] rows and serving experts per rank -> [...] time."""
        gemm = (
            self.gemm_fixed_us
            + active * self.expert_bytes / self.hbm_bytes_per_us
            + rows * self.us_per_row
        )
        a2a = (
            self.a2a_latency_us + rows.max(dim=-1).values * self.row_bytes / self.link_bytes_per_us
        )
        return gemm.max(dim=-1).values + 2 * a2a

    def from_gemm_measurement(self, measured: dict[str, Any]) -> StepCosts:
        """These costs with the expert GEMM's from ``benchmarks/moe/moe.py gemm``'s JSON (the
        grouped kernel's gate_up + down device time at several token counts): time = fixed +
        experts hit x (expert bytes / bandwidth) + rows x time per row, fitted by least
        squares; bf16 experts of the measured shape, and its hidden size for the rows the
        all-to-all sends (``row_bytes``); the other all-to-all constants stay."""
        shape = measured["shape"]
        points = [
            (r["active_experts"], r["tokens"] * shape["top_k"])
            for r in measured["rows"]
        ]  # fmt: skip
        if len(points) < 3:
            raise ValueError("a GEMM measurement needs at least three token counts to fit")
        design = torch.tensor([[1.0, e, n] for e, n in points], dtype=torch.float64)
        times = torch.tensor(
            [r["gate_up"]["grouped_us"] + r["down"]["grouped_us"] for r in measured["rows"]],
            dtype=torch.float64,
        )
        fixed, per_expert, per_row = torch.linalg.lstsq(design, times[:, None]).solution[:, 0]
        if per_expert <= 0 or per_row < 0 or fixed < 0:
            raise ValueError(
                f"the GEMM measurement does not fit time = fixed + experts x a + rows x b "
                f"(fixed {float(fixed):.2f} us, a {float(per_expert):.3f}, b {float(per_row):.4f})"
            )
        expert_bytes = 3 * shape["hidden"] * shape["inter"] * 2
        return replace(
            self,
            expert_bytes=expert_bytes,
            hbm_bytes_per_us=expert_bytes / float(per_expert),
            us_per_row=float(per_row),
            row_bytes=shape["hidden"] * 2,
            gemm_fixed_us=float(fixed),
        )

    def from_a2a_measurement(self, measured: dict[str, Any]) -> StepCosts:
        """These costs with the all-to-all's from ``benchmarks/moe/ep_check.py``'s
        ``a2a.json`` (the slowest rank's time per ``all_to_all_single`` of ``rows`` bf16 rows
        of ``hidden`` values): time = latency + bytes sent / bandwidth, fitted by least
        squares."""
        rows = measured["rows"]
        if len(rows) < 2:
            raise ValueError("an all-to-all measurement needs at least two sizes to fit")
        sent = [r["rows"] * r["hidden"] * 2 for r in rows]
        design = torch.tensor([[1.0, b] for b in sent], dtype=torch.float64)
        times = torch.tensor([r["us"] for r in rows], dtype=torch.float64)
        latency, per_byte = torch.linalg.lstsq(design, times[:, None]).solution[:, 0]
        if per_byte <= 0 or latency < 0:
            raise ValueError(
                f"the all-to-all measurement does not fit time = latency + bytes / bandwidth "
                f"(latency {float(latency):.2f} us, {float(per_byte):.3g} us per byte)"
            )
        return replace(self, a2a_latency_us=float(latency), link_bytes_per_us=1 / float(per_byte))


@dataclass(frozen=True)
class SimConfig:
    num_ranks: int
    num_redundant: int
    interval_steps: int
    num_groups: int = 1
    ranks_per_node: int = 8
    policy: str = "global"


def _step_stats(placement: Placement, steps: torch.Tensor, costs: StepCosts) -> tuple[float, float]:
    """(mean step imbalance, mean modelled step time) of ``steps`` [n, experts]."""
    rows = placement.rank_loads(steps)
    padded = torch.cat([steps, torch.zeros_like(steps[:, :1])], dim=1)
    serving = (padded[:, placement.slots] > 0) & (placement.shares > 0)
    step_imbalance = rows.max(dim=1).values / rows.mean(dim=1).clamp(min=1e-9)
    return float(step_imbalance.mean()), float(costs.step_us(rows, serving.sum(dim=-1)).mean())


def simulate_layer(
    trace: torch.Tensor, cfg: SimConfig, costs: StepCosts, balanced: bool
) -> dict[str, float]:
    """One layer's trace [steps, experts] replayed with (balanced) or without EPLB."""
    num_experts = trace.shape[1]
    placement = static_placement(num_experts, cfg.num_ranks)
    interval: list[float] = []
    step_imb: list[float] = []
    step_us: list[float] = []
    for start in range(0, trace.shape[0], cfg.interval_steps):
        window = trace[start : start + cfg.interval_steps]
        if start > 0 or trace.shape[0] <= cfg.interval_steps:
            interval.append(imbalance(placement.rank_loads(window.sum(dim=0))))
            imb, us = _step_stats(placement, window, costs)
            step_imb.append(imb)
            step_us.append(us)
        if balanced:
            nodes = max(1, cfg.num_ranks // cfg.ranks_per_node)
            placement = rebalance(
                window.sum(dim=0),
                cfg.num_ranks,
                cfg.num_redundant,
                cfg.num_groups,
                nodes,
                cfg.policy,
            )
    return {
        "interval_imbalance": sum(interval) / max(1, len(interval)),
        "step_imbalance": sum(step_imb) / len(step_imb),
        "step_us": sum(step_us) / len(step_us),
    }


def simulate(trace: torch.Tensor, cfg: SimConfig, costs: StepCosts) -> dict[str, object]:
    """trace [steps, layers, experts] -> both runs' metrics, averaged over layers (the step
    time summed over layers)."""
    result: dict[str, object] = {"config": asdict(cfg)}
    for name, balanced in (("static", False), ("eplb", True)):
        layers = [simulate_layer(trace[:, i], cfg, costs, balanced) for i in range(trace.shape[1])]
        result[name] = {
            "interval_imbalance": sum(r["interval_imbalance"] for r in layers) / len(layers),
            "step_imbalance": sum(r["step_imbalance"] for r in layers) / len(layers),
            "moe_step_us": sum(r["step_us"] for r in layers),
        }
    return result
