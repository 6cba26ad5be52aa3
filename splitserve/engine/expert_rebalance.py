"""EPLB while serving: an expert-parallel group moves its experts to where the load is.

Every ``eplb.interval_steps`` steps of the group (the ranks step in lockstep, so every rank
reaches the same step at once), each MoE layer's expert load since the last rebalance (the
(token, expert) pairs each rank routed, summed over the group with one all-reduce) goes
through DeepSeek's placement (splitserve/eplb/rebalance.py, the global policy that DeepSeek
uses for decode): ``redundant_experts`` extra copies of the hottest experts, the copies packed
onto the ranks to even their loads. Then the weights move: every new slot takes its expert
from a rank that held it before (itself when it did), in one all-to-all of gate|up rows and
one of down rows per layer, and the layer switches to the new placement. Copies of an expert
hold the same weights, so which copy serves a row does not change the output: a rebalance
changes where the work runs, never the tokens.

The move runs inside one step of the group: the requests pause for that step's exchange of
the weights (on CPU with Gloo, the tiny test models' layers move in milliseconds), nothing is
dropped. CUDA graphs hold their weight tensors' addresses, so a rebalance on a GPU would
need them captured again; expert parallelism runs on CPU only so far (docs/moe.md).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from splitserve.engine.config import EPLBConfig
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.eplb.placement import Placement, imbalance
from splitserve.eplb.rebalance import rebalance

if TYPE_CHECKING:
    from splitserve.engine.layers.moe import SparseMoE

log = logging.getLogger(__name__)


def live_rebalancer(model: nn.Module, config: EPLBConfig | None) -> LiveRebalancer | None:
    """The engine's rebalancer for ``model`` (None without an ``eplb`` config)."""
    if config is None:
        return None
    return LiveRebalancer(getattr(model, "moe_layers", list)(), config)


class LiveRebalancer:
    """Counts the group's steps and rebalances every MoE layer every ``interval_steps``."""

    def __init__(self, layers: list[SparseMoE], config: EPLBConfig) -> None:
        if not layers or any(layer.ep is None for layer in layers):
            raise ValueError("eplb needs a mixture-of-experts model in an expert-parallel group")
        self.layers = layers
        self.config = config
        self.steps = 0
        self.rebalances = 0
        self.imbalance = 0.0
        """Rank load max/mean (mean over layers) of the last interval, under the placement
        the group ran it with."""
        for layer in layers:
            layer.expert_load.zero_()

    def after_step(self) -> None:
        """Called by every rank after each of the group's steps (a forward or an idle pass)."""
        self.steps += 1
        if self.steps % self.config.interval_steps == 0:
            self.rebalance()

    def rebalance(self) -> None:
        """New placements from the load since the last one; the weights move to them."""
        before, after = [], []
        for layer in self.layers:
            ep = layer.ep
            assert ep is not None
            load = layer.expert_load.clone()
            dist.all_reduce(load, group=ep.group)
            layer.expert_load.zero_()
            weights = load.to("cpu", torch.float64)  # the placement is computed on the host
            placement = rebalance(weights, ep.size, self.config.redundant_experts, policy="global")
            new = ExpertParallel(ep.rank, ep.size, placement.slots, placement.shares, ep.group)
            before.append(imbalance(Placement(ep.slots, ep.shares).rank_loads(weights)))
            after.append(imbalance(placement.rank_loads(weights)))
            move_experts(layer, new)
        self.rebalances += 1
        self.imbalance = sum(before) / len(before)
        log.info(
            "eplb: rebalance %d at step %d: rank load max/mean %.3f -> %.3f (mean over layers)",
            self.rebalances,
            self.steps,
            self.imbalance,
            sum(after) / len(after),
        )


def sources(old: ExpertParallel, new: ExpertParallel) -> torch.Tensor:
    """[ranks, new width] int64: the rank each new slot takes its expert from (-1: an empty
    slot). A rank that held the expert keeps its own copy; else the copies of the old
    placement take turns, so that one hot expert's new copies come from all its old ones."""
    holders: dict[int, list[int]] = {}
    for rank, row in enumerate(old.slots.tolist()):
        for expert in row:
            if expert >= 0 and rank not in holders.setdefault(expert, []):
                holders[expert].append(rank)
    turns: dict[int, int] = {}
    table = torch.full(new.slots.shape, -1, dtype=torch.int64)
    for rank, row in enumerate(new.slots.tolist()):
        for slot, expert in enumerate(row):
            if expert < 0:
                continue
            if expert not in holders:
                raise ValueError(f"expert {expert} is in no slot of the old placement")
            if rank in holders[expert]:
                table[rank, slot] = rank
            else:
                turn = turns.get(expert, 0)
                turns[expert] = turn + 1
                table[rank, slot] = holders[expert][turn % len(holders[expert])]
    return table


def move_experts(layer: SparseMoE, new: ExpertParallel) -> None:
    """Give the layer the weights of ``new``'s slots for its rank, received from the ranks
    ``sources`` names (a collective: every rank of the group calls it), then switch to it."""
    old = layer.ep
    assert old is not None
    source = sources(old, new)
    local = {e: s for s, e in enumerate(old.local_slots) if e >= 0}
    # What this rank sends: for each rank in order, the new slots it sources, in slot order.
    send_slots = [
        local[int(new.slots[rank, slot])]
        for rank in range(new.size)
        for slot in range(new.width)
        if int(source[rank, slot]) == old.rank
    ]
    send = [int((source[rank] == old.rank).sum()) for rank in range(new.size)]
    mine = source[new.rank]
    recv = [int((mine == rank).sum()) for rank in range(new.size)]
    # Received rows come grouped by source rank, each group in slot order.
    order = sorted((int(s), slot) for slot, s in enumerate(mine.tolist()) if s >= 0)
    for name in ("w13", "w2"):
        weight: nn.Parameter = getattr(layer, name)
        # A rank may send nothing (every slot it held is taken from elsewhere or dropped):
        # the row width is explicit, as reshape(0, -1) is ambiguous.
        width = weight[0].numel()
        rows = weight.detach()[send_slots].reshape(len(send_slots), width)
        got = rows.new_empty((sum(recv), width))
        new.all_to_all(got, rows.contiguous(), recv, send)
        moved = weight.new_zeros((new.width, *weight.shape[1:]))
        for index, (_, slot) in enumerate(order):
            moved[slot] = got[index].view(weight.shape[1:])
        setattr(layer, name, nn.Parameter(moved, requires_grad=False))
    layer.ep = new
