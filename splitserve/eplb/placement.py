"""Expert-parallel load balancing (EPLB): where each expert's copies live.

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
from dataclasses import dataclass

import torch
import torch.nn.functional as F


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


def refine(packs: list[list[int]], weights: torch.Tensor, max_moves: int = 10_000) -> None:
    """Local search after the greedy packing, in place: while moving one item from the most
    loaded pack to a pack with room, or swapping it with a lighter item of another pack, would
    bring both packs below the most loaded one's load, make the move that lowers it most."""
    capacity = max(len(p) for p in packs)
    w = weights.double().tolist()
    loads = [sum(w[i] for i in p) for p in packs]
    for _ in range(max_moves):
        top = max(range(len(packs)), key=loads.__getitem__)
        best = (loads[top], -1, -1, -1)
        for a, item in enumerate(packs[top]):
            for other, pack in enumerate(packs):
                partners = [(b, w[j]) for b, j in enumerate(pack)]
                if len(pack) < capacity:
                    partners.append((-1, 0.0))
                for b, wb in partners if other != top else ():
                    delta = w[item] - wb
                    peak = max(loads[top] - delta, loads[other] + delta)
                    if delta > 0 and peak < best[0] - 1e-12:
                        best = (peak, a, other, b)
        if best[1] < 0:
            return
        _, a, other, b = best
        item = packs[top].pop(a)
        moved = packs[other].pop(b) if b >= 0 else None
        packs[other].append(item)
        delta = w[item] - (0.0 if moved is None else w[moved])
        if moved is not None:
            packs[top].append(moved)
        loads[top] -= delta
        loads[other] += delta


def place_on_ranks(experts: list[int], load: torch.Tensor, slots: int, ranks: int) -> Placement:
    """The better (lower peak on ``load``) of two placements of ``experts`` on ``ranks`` ranks
    with ``slots`` copies: ``replicate_and_pack`` and ``fill_to_level``."""
    packed = replicate_and_pack(experts, load, slots, ranks)
    filled = fill_to_level(experts, load, slots, ranks)
    if filled is None:
        return packed
    peak = [float(p.rank_loads(load).max()) for p in (packed, filled)]
    return filled if peak[1] < peak[0] else packed


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
    experts: list[int], load: torch.Tensor, slots: int, ranks: int, steps: int = 20
) -> Placement | None:
    """The lowest level (a bisection over ``steps`` halvings) to which the ranks can be filled:
    every expert gets the fewest copies whose load fits under the level; experts of one copy
    go heaviest first onto the fullest rank they fit on (best fit), then each replicated
    expert's load is poured into the ranks with the most room, one copy per rank it touches,
    as long as slots last. Where the greedy ``replicate_and_pack`` leaves large single
    experts with no partner small enough (many ranks, few slots each), this packs to a
    level instead. None if no level was found below twice the mean."""
    weights = load[experts].double()
    mean = float(weights.sum()) / ranks
    if mean <= 0:
        return None
    low, high, best = 1.0, 2.0, None
    for _ in range(steps):
        level = (low + high) / 2
        placed = _fill(weights.tolist(), slots, ranks, level * mean)
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
    weights: list[float], slots: int, ranks: int, cap: float
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


def repack(placement: Placement, load: torch.Tensor) -> Placement:
    """``refine`` on the copies as they stand (with their shares): swaps a light copy onto
    the most loaded rank where shifting shares alone cannot help."""
    slots, shares = placement.slots, placement.shares
    held = torch.nonzero(slots >= 0)
    weights = load.double()[slots[slots >= 0]] * shares[slots >= 0]
    packs: list[list[int]] = [[] for _ in range(slots.shape[0])]
    for item, rank in enumerate(held[:, 0].tolist()):
        packs[rank].append(item)
    refine(packs, weights)
    width = slots.shape[1]
    new_slots = torch.full_like(slots, -1)
    new_shares = torch.zeros_like(shares)
    for rank, pack in enumerate(packs):
        for slot, item in enumerate(pack[:width]):
            r, s = held[item].tolist()
            new_slots[rank, slot], new_shares[rank, slot] = slots[r, s], shares[r, s]
    return Placement(new_slots, new_shares)


def level_shares(placement: Placement, load: torch.Tensor, sweeps: int = 50) -> Placement:
    """Shifts tokens between the copies of each replicated expert: expert by expert, its load
    is water-filled over the ranks that hold its copies (each copy tops its rank up to one
    common level), in sweeps until nothing moves. Copies then serve uneven shares of their
    expert's tokens, which the dispatch draws in those proportions; it lowers the peak where
    moving whole copies cannot."""
    slots, shares = placement.slots, placement.shares.clone()
    w = load.double()
    holders: dict[int, dict[int, list[int]]] = {}  # expert -> rank -> its slots there
    for rank, slot in torch.nonzero(slots >= 0).tolist():
        holders.setdefault(int(slots[rank, slot]), {}).setdefault(rank, []).append(slot)
    loads = Placement(slots, shares).rank_loads(w)
    for _ in range(sweeps):
        moved = 0.0
        for expert, by_rank in holders.items():
            if len(by_rank) < 2 or w[expert] <= 0:
                continue
            ranks = torch.tensor(list(by_rank))
            old = torch.tensor([float(shares[r, by_rank[r]].sum()) for r in by_rank]) * w[expert]
            new = water_fill(loads[ranks] - old, float(w[expert]))
            loads.index_add_(0, ranks, new - old)
            for rank, amount in zip(by_rank, new.tolist()):
                shares[rank, by_rank[rank]] = amount / float(w[expert]) / len(by_rank[rank])
            moved = max(moved, float((new - old).abs().max()))
        if moved <= 1e-6 * float(loads.mean()):
            break
    return Placement(slots, shares)


def water_fill(base: torch.Tensor, amount: float) -> torch.Tensor:
    """How to split ``amount`` over bins at levels ``base`` so that the filled ones reach one
    common level and the others get nothing (the lowest bins fill first)."""
    order = torch.sort(base).values
    for count in range(len(order), 0, -1):
        level = (amount + float(order[:count].sum())) / count
        if level >= float(order[count - 1]):
            return (level - base).clamp(min=0)
    raise AssertionError("unreachable: one bin always fills")
