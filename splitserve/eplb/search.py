"""Local search on a placement, after the greedy steps of ``eplb/rebalance.py`` (none of it
is in DeepSeek's code):

- ``refine``: one copy moved, or two swapped, off the most loaded rank;
- ``repack``: ``refine`` on the copies of a placement as they stand, with their shares;
- ``repartition``: two ranks' copies split anew between them, every split tried, pair by pair;
- ``level_shares``: the tokens of a replicated expert shifted between its copies
  (``water_fill``), so copies serve uneven shares.
"""

from __future__ import annotations

import functools

import torch

from splitserve.eplb.placement import Placement


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


def repartition(
    placement: Placement, load: torch.Tensor, max_copies: int = 12, rounds: int = 64
) -> Placement:
    """Pairwise re-partition: in rounds, each rank, the most loaded first, takes the best of
    its re-partitions with every less loaded rank: the copies the two hold split anew between
    them (every split tried, each side within the placement's slots per rank and with at most
    one copy of an expert), the one that narrows their gap most. Each move lowers the sum of
    squared rank loads, so the rounds end; they find moves ``refine`` cannot (two copies for
    one, two for two) and even the middle ranks, which frees partners for the peak. Shares
    stay as they are (``level_shares`` moves them). With more than ``max_copies`` slots in
    two ranks (2 ** slots splits to try) the placement is returned as it is."""
    slots = placement.slots
    width = slots.shape[1]
    if 2 * width > max_copies:
        return placement
    experts, amounts = slots.clone(), _amounts(placement, load)
    sides = _splits(width)
    tolerance = 1e-9 * max(float(amounts.sum()), 1e-30)
    for _ in range(rounds):
        moves = 0
        for high in torch.argsort(amounts.sum(dim=1), descending=True).tolist():
            moves += _best_move(experts, amounts, high, sides, width, tolerance)
        if not moves:
            break
    return _placement(experts, amounts, load)


def _best_move(
    experts: torch.Tensor,
    amounts: torch.Tensor,
    high: int,
    sides: torch.Tensor,
    width: int,
    tolerance: float,
) -> int:
    """Re-partitions rank ``high`` with the less loaded rank where that narrows the gap most,
    in place; 1 if it moved copies, else 0."""
    loads = amounts.sum(dim=1)
    lows = torch.nonzero(loads < loads[high] - tolerance).flatten()
    if not len(lows):
        return 0
    pair = torch.cat([amounts[high].expand(len(lows), -1), amounts[lows]], dim=1)
    held = torch.cat([experts[high].expand(len(lows), -1), experts[lows]], dim=1)
    real = (held >= 0).double()
    first = pair @ sides.T  # [lows, splits]: the load the split leaves on ``high``
    count = real @ sides.T
    total = loads[high] + loads[lows]
    valid = (count <= width) & (real.sum(dim=1, keepdim=True) - count <= width)
    gap = (loads[high] - loads[lows])[:, None]
    gain = torch.where(valid, gap**2 - (total[:, None] - 2 * first) ** 2, -1.0)
    gain = gain.flatten()
    while True:
        index = int(torch.argmax(gain))
        row, split = divmod(index, len(sides))
        if float(gain[index]) <= tolerance * float(gap[row]):
            return 0
        gain[index] = -1.0
        keep = sides[split].bool()
        moved = [held[row][keep], held[row][~keep]]
        if all(len(set(e[e >= 0].tolist())) == int((e >= 0).sum()) for e in moved):
            for rank, side in ((high, keep), (int(lows[row]), ~keep)):
                mine = side & (held[row] >= 0)
                kept = int(mine.sum())
                experts[rank], amounts[rank] = -1, 0.0
                experts[rank, :kept] = held[row][mine]
                amounts[rank, :kept] = pair[row][mine]
            return 1


@functools.lru_cache(maxsize=16)
def _splits(width: int) -> torch.Tensor:
    """[2 ** (2 * width), 2 * width] float64: every subset of two ranks' slots (the part that
    stays on the first rank)."""
    slots = 2 * width
    return (torch.arange(2**slots)[:, None] >> torch.arange(slots) & 1).double()


def spend_slots(
    placement: Placement, load: torch.Tensor, slots: int, moves: int = 256
) -> Placement:
    """Uses the placement's free slots (it holds fewer than ``slots`` copies, or copies it can
    merge) against the peak, one move at a time while the peak falls:

    - a new copy of an expert of the most loaded rank on the least loaded rank with a free
      slot, the expert's load water-filled over its copies' ranks anew;
    - else the smallest copy of a replicated expert dropped, its load water-filled over the
      expert's other ranks, when that keeps them below the peak (it frees a slot for the
      first move)."""
    experts, amounts = placement.slots.clone(), _amounts(placement, load)
    for _ in range(moves):
        loads = amounts.sum(dim=1)
        peak = float(loads.max())
        tolerance = 1e-9 * peak
        if int((experts >= 0).sum()) < slots:
            if not _add_copy(experts, amounts, peak - tolerance):
                break
        elif not _drop_copy(experts, amounts, peak - tolerance):
            break
    return _placement(experts, amounts, load)


def _amounts(placement: Placement, load: torch.Tensor) -> torch.Tensor:
    """[ranks, slots] the load each copy serves (0 in empty slots)."""
    held = placement.slots >= 0
    return torch.where(held, load.double()[placement.slots.clamp(min=0)] * placement.shares, 0.0)


def _placement(experts: torch.Tensor, amounts: torch.Tensor, load: torch.Tensor) -> Placement:
    """The placement whose copies serve ``amounts`` (a copy of an idle expert: share 1)."""
    w = load.double()[experts.clamp(min=0)]
    shares = torch.where(experts >= 0, amounts / torch.where(w > 0, w, 1.0), 0.0)
    return Placement(experts, torch.where((experts >= 0) & (w <= 0), 1.0, shares))


def _refill(
    experts: torch.Tensor, amounts: torch.Tensor, expert: int, ranks: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ranks' loads without ``expert``, its load water-filled over ``ranks``)."""
    held = experts == expert
    total = float(amounts[held].sum())
    base = (amounts.sum(dim=1) - (amounts * held).sum(dim=1))[ranks]
    return base, water_fill(base, total)


def _set(
    experts: torch.Tensor, amounts: torch.Tensor, expert: int, ranks: list[int], fill: torch.Tensor
) -> None:
    held = experts == expert
    amounts[held] = 0.0
    experts[held] = -1
    for rank, amount in zip(ranks, fill.tolist()):
        free = int(torch.nonzero(experts[rank] < 0)[0])
        experts[rank, free], amounts[rank, free] = expert, amount
    order = torch.argsort((experts < 0).int(), dim=1, stable=True)
    experts.copy_(experts.gather(1, order))
    amounts.copy_(amounts.gather(1, order))


def _add_copy(experts: torch.Tensor, amounts: torch.Tensor, below: float) -> bool:
    loads = amounts.sum(dim=1)
    top = int(torch.argmax(loads))
    open_ranks = torch.nonzero((experts < 0).any(dim=1)).flatten().tolist()
    for slot in torch.argsort(amounts[top], descending=True).tolist():
        expert = int(experts[top, slot])
        if expert < 0:
            continue
        holders = sorted({int(r) for r in torch.nonzero(experts == expert)[:, 0]})
        free = [r for r in open_ranks if r not in holders]
        if not free:
            continue
        ranks = [*holders, min(free, key=lambda r: float(loads[r]))]
        base, fill = _refill(experts, amounts, expert, ranks)
        if float((base + fill).max()) < below:
            _set(experts, amounts, expert, ranks, fill)
            return True
    return False


def _drop_copy(experts: torch.Tensor, amounts: torch.Tensor, below: float) -> bool:
    best: tuple[float, int, list[int], torch.Tensor] | None = None
    for expert in torch.unique(experts[experts >= 0]).tolist():
        where = torch.nonzero(experts == expert)
        if len(where) < 2:
            continue
        smallest = int(torch.argmin(amounts[where[:, 0], where[:, 1]]))
        ranks = sorted({int(r) for i, r in enumerate(where[:, 0].tolist()) if i != smallest})
        if len(ranks) < len(where) - 1:
            continue  # two copies on one rank
        base, fill = _refill(experts, amounts, expert, ranks)
        high = float((base + fill).max())
        if high < below and (best is None or high < best[0]):
            best = (high, expert, ranks, fill)
    if best is None:
        return False
    _set(experts, amounts, best[1], best[2], best[3])
    return True


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
