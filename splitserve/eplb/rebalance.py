"""Expert-parallel load balancing (EPLB): a new placement from one layer's expert load.

DeepSeek's published approach (github.com/deepseek-ai/EPLB), as pure functions on one layer's
per-expert load:

1. ``pack_groups``: expert groups onto nodes, each node the same number of groups, the
   heaviest group first onto the lightest node (so that group-limited routing stays inside
   few nodes);
2. ``replicate``: within each node, the node's redundant slots go one at a time to the expert
   whose load per copy is highest;
3. ``balanced_packing``: the node's copies onto its ranks, heaviest first onto the lightest
   rank that has a free slot; then ``refine`` (not in DeepSeek's code) moves or swaps copies
   between the most loaded rank and the others while that lowers the peak.

``rebalance`` runs the three steps (``hierarchical``) or, when groups do not divide evenly
over nodes or the policy is ``global``, the last two over all ranks as one node (DeepSeek
uses the global policy for decode). Unlike DeepSeek's code, the slots need not divide evenly
over the ranks: 256 experts and 32 redundant copies on 64 ranks give half the ranks 5 slots
and half 4; a ``Placement`` pads the short ranks with -1.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from splitserve.eplb.placement import Placement
from splitserve.eplb.search import level_shares, refine, repack, repartition, spend_slots


def balanced_packing(weights: torch.Tensor, num_packs: int) -> list[list[int]]:
    """Item indices per pack: heaviest item first onto the lightest pack with room (ties to
    the lower index); each pack takes at most ceil(items / packs)."""
    capacity = -(-weights.numel() // num_packs)
    loads = [0.0] * num_packs
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    for item in torch.argsort(weights.double(), descending=True, stable=True).tolist():
        pack = min((p for p in range(num_packs) if len(packs[p]) < capacity), key=loads.__getitem__)
        packs[pack].append(item)
        loads[pack] += float(weights[item])
    return packs


def replicate(load: torch.Tensor, num_slots: int) -> torch.Tensor:
    """[experts] copies of each expert for ``num_slots`` slots: one each, then every extra
    slot to the expert with the highest load per copy (ties to the lower index)."""
    if num_slots < load.numel():
        raise ValueError(f"{num_slots} slots cannot hold {load.numel()} experts")
    copies = torch.ones_like(load, dtype=torch.int64)
    for _ in range(num_slots - load.numel()):
        copies[int(torch.argmax(load.double() / copies))] += 1
    return copies


def place_on_ranks(experts: list[int], load: torch.Tensor, slots: int, ranks: int) -> Placement:
    """A placement of ``experts`` on ``ranks`` ranks with ``slots`` copies: the better (lower
    peak on ``load``) of ``replicate_and_pack`` and ``fill_to_level``, then ``repartition``
    and ``level_shares`` in turn (neither raises the peak)."""
    placement = replicate_and_pack(experts, load, slots, ranks)
    for whole_rest in (False, True):
        filled = fill_to_level(experts, load, slots, ranks, whole_rest=whole_rest)
        if filled is not None and _peak(filled, load) < _peak(placement, load):
            placement = filled
    for _ in range(3):
        polished = level_shares(repartition(placement, load), load)
        polished = level_shares(spend_slots(polished, load, slots), load)
        if _peak(polished, load) >= _peak(placement, load) * (1 - 1e-6):
            break
        placement = polished
    return placement


def _peak(placement: Placement, load: torch.Tensor) -> float:
    return float(placement.rank_loads(load).max())


def replicate_and_pack(experts: list[int], load: torch.Tensor, slots: int, ranks: int) -> Placement:
    """Replicates ``experts`` (logical ids) into ``slots`` copies, packs them onto ``ranks``
    ranks, then alternates ``level_shares`` and ``repack`` among these ranks only."""
    copies = replicate(load[experts], slots)
    owners = torch.repeat_interleave(torch.tensor(experts), copies)
    per_copy = torch.repeat_interleave(load[experts].double() / copies, copies)
    packs = balanced_packing(per_copy, ranks)
    refine(packs, per_copy)
    width = max(len(p) for p in packs)
    table = torch.tensor([owners[p].tolist() + [-1] * (width - len(p)) for p in packs])
    placement = Placement.even(table, load.numel())
    for _ in range(3):
        placement = repack(level_shares(placement, load), load)
    return level_shares(placement, load)


def fill_to_level(
    experts: list[int],
    load: torch.Tensor,
    slots: int,
    ranks: int,
    steps: int = 20,
    whole_rest: bool = False,
) -> Placement | None:
    """The lowest level (a bisection over ``steps`` halvings) to which the ranks can be filled:
    every expert gets the fewest copies whose load fits under the level; experts of one copy
    go heaviest first onto the fullest rank they fit on (best fit), then each replicated
    expert's load is poured into the ranks with the most room, one copy per rank it touches,
    as long as slots last (``whole_rest``: what is left of an expert goes whole into the
    fullest rank it fits, where one does: fewer copies, but it can take slots that later
    experts needed, so ``place_on_ranks`` tries both). Where the greedy
    ``replicate_and_pack`` leaves large single experts with no partner small enough (many
    ranks, few slots each), this packs to a level instead. None if no level was found below
    twice the mean."""
    weights = load[experts].double()
    mean = float(weights.sum()) / ranks
    if mean <= 0:
        return None
    low, high, best = 1.0, 2.0, None
    for _ in range(steps):
        level = (low + high) / 2
        placed = _fill(weights.tolist(), slots, ranks, level * mean, whole_rest)
        if placed is None:
            low = level
        else:
            high, best = level, placed
    if best is None:
        return None
    width = max(len(rank) for rank in best)
    table = torch.full((ranks, width), -1, dtype=torch.int64)
    shares = torch.zeros((ranks, width), dtype=torch.float64)
    for r, rank in enumerate(best):
        for slot, (item, amount) in enumerate(rank):
            table[r, slot] = experts[item]
            weight = float(weights[item])
            shares[r, slot] = amount / weight if weight > 0 else 1.0  # an idle expert: one copy
    return Placement(table, shares)


def _fill(
    weights: list[float], slots: int, ranks: int, cap: float, whole_rest: bool
) -> list[list[tuple[int, float]]] | None:
    """(item, load) per rank with every rank at most ``cap``, or None (see fill_to_level)."""
    width = -(-slots // ranks)
    copies = [max(1, math.ceil(w / cap)) if w > 0 else 1 for w in weights]
    if sum(copies) > slots:
        return None
    packed: list[list[tuple[int, float]]] = [[] for _ in range(ranks)]
    loads = [0.0] * ranks
    order = sorted(range(len(weights)), key=lambda i: -weights[i])
    for item in (i for i in order if copies[i] == 1):
        fits = [
            r for r in range(ranks) if len(packed[r]) < width and loads[r] + weights[item] <= cap
        ]
        if not fits:
            return None
        rank = max(fits, key=loads.__getitem__)
        packed[rank].append((item, weights[item]))
        loads[rank] += weights[item]
    pieces = slots - sum(1 for c in copies if c == 1)
    for item in (i for i in order if copies[i] > 1):
        rest = weights[item]
        while rest > 1e-9 * cap:
            room = [r for r in range(ranks) if len(packed[r]) < width and loads[r] < cap]
            if not room or pieces == 0:
                return None
            fits = [r for r in room if cap - loads[r] >= rest] if whole_rest else []
            if fits:  # the rest whole, into the fullest rank it fits
                rank = max(fits, key=loads.__getitem__)
            else:  # as much as fits, into the rank with the most room
                rank = max(room, key=lambda r: cap - loads[r])
            amount = min(rest, cap - loads[rank])
            packed[rank].append((item, amount))
            loads[rank] += amount
            rest -= amount
            pieces -= 1
    return packed


def pack_groups(load: torch.Tensor, num_groups: int, num_nodes: int) -> list[list[int]]:
    """Expert ids per node: whole groups of consecutive experts, as balanced as can be."""
    groups = load.double().view(num_groups, -1)
    size = groups.shape[1]
    nodes = balanced_packing(groups.sum(dim=1), num_nodes)
    return [[g * size + i for g in sorted(node) for i in range(size)] for node in nodes]


def rebalance(
    load: torch.Tensor,
    num_ranks: int,
    num_redundant: int,
    num_groups: int = 1,
    num_nodes: int = 1,
    policy: str = "hierarchical",
) -> Placement:
    """A placement of one layer's experts (``load`` [experts], e.g. the (token, slot) counts
    of the last interval) on ``num_ranks`` ranks over ``num_nodes`` nodes, with
    ``num_redundant`` extra copies."""
    num_experts = load.numel()
    hierarchical = (
        policy == "hierarchical"
        and num_nodes > 1
        and num_groups % num_nodes == 0
        and num_redundant % num_nodes == 0
    )
    if num_ranks % num_nodes or num_experts % num_groups:
        raise ValueError("ranks must divide over nodes and experts over groups")
    if not hierarchical:
        num_nodes = 1
    nodes = pack_groups(load, num_groups, num_nodes) if hierarchical else [list(range(num_experts))]
    slots_per_node = (num_experts + num_redundant) // num_nodes
    parts = [place_on_ranks(e, load, slots_per_node, num_ranks // num_nodes) for e in nodes]
    width = max(p.slots.shape[1] for p in parts)
    pad = [width - p.slots.shape[1] for p in parts]
    slots = torch.cat([F.pad(p.slots, (0, n), value=-1) for p, n in zip(parts, pad)])
    shares = torch.cat([F.pad(p.shares, (0, n)) for p, n in zip(parts, pad)])
    return Placement(slots, shares)
