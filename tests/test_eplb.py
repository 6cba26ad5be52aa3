"""EPLB placement on small loads with exact placements, traces, and the simulator."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from splitserve.engine.expert_rebalance import sources
from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.eplb.placement import Placement, imbalance, static_placement
from splitserve.eplb.rebalance import (
    balanced_packing,
    fill_to_level,
    rebalance,
    replicate,
    replicate_and_pack,
)
from splitserve.eplb.search import level_shares, repartition, spend_slots, water_fill
from splitserve.eplb.simulate import SimConfig, StepCosts, simulate
from splitserve.eplb.traces import load_served, load_trace, save_trace, zipf_trace


def test_balanced_packing_puts_the_heaviest_on_the_lightest_pack_with_room() -> None:
    packs = balanced_packing(torch.tensor([5.0, 4, 3, 2, 1, 1]), 2)
    # 5 -> p0, 4 -> p1, 3 -> p1 (7), 2 -> p0 (7), 1 -> p0 (tie: lower index), 1 -> p1 (p0 full)
    assert packs == [[0, 3, 4], [1, 2, 5]]


def test_replicate_gives_each_extra_slot_to_the_highest_load_per_copy() -> None:
    assert replicate(torch.tensor([6.0, 3, 1]), 5).tolist() == [3, 1, 1]
    with pytest.raises(ValueError, match="cannot hold"):
        replicate(torch.tensor([1.0, 1, 1]), 2)


def test_water_fill_raises_the_lowest_bins_to_one_level() -> None:
    assert water_fill(torch.tensor([1.0, 3.0, 10.0]), 8.0).tolist() == [5.0, 3.0, 0.0]


def test_rebalance_global_replicates_the_hot_expert_and_levels_its_copies() -> None:
    load = torch.tensor([8.0, 1, 1, 2])
    placement = rebalance(load, num_ranks=2, num_redundant=2, policy="global")
    assert placement.slots.tolist() == [[0, 0, 2], [0, 3, 1]]
    assert placement.shares.tolist() == [[0.3125, 0.3125, 1.0], [0.375, 1.0, 1.0]]
    assert placement.rank_loads(load).tolist() == [6.0, 6.0]
    assert placement.replicas(4).tolist() == [3, 1, 1, 1]


def test_rebalance_hierarchical_keeps_each_group_in_its_node() -> None:
    load = torch.tensor([8.0, 1, 1, 2, 1, 1, 1, 1])
    placement = rebalance(load, num_ranks=4, num_redundant=4, num_groups=2, num_nodes=2)
    assert placement.slots.tolist() == [[0, 0, 2], [0, 3, 1], [6, 4, 5], [7, 4, 5]]
    assert placement.rank_loads(load).tolist() == [6.0, 6.0, 2.0, 2.0]
    glob = rebalance(load, num_ranks=4, num_redundant=4, num_groups=2, num_nodes=2, policy="global")
    assert imbalance(glob.rank_loads(load)) == 1.0


def test_static_placement_and_uneven_slots_per_rank() -> None:
    static = static_placement(4, 2)
    assert static.slots.tolist() == [[0, 1], [2, 3]]
    assert static.rank_loads(torch.tensor([3.0, 1, 1, 1])).tolist() == [4.0, 2.0]
    # 4 experts + 1 copy on 2 ranks: one rank has 3 slots, the other 2 and an empty one.
    placement = rebalance(torch.tensor([4.0, 2, 1, 1]), 2, 1, policy="global")
    assert sorted((placement.slots >= 0).sum(dim=1).tolist()) == [2, 3]
    assert isinstance(placement, Placement)
    assert placement.rank_loads(torch.tensor([4.0, 2, 1, 1])).tolist() == [4.0, 4.0]


def test_zipf_trace_counts_top_k_distinct_experts_per_token(tmp_path: Path) -> None:
    trace = zipf_trace(16, 4, tokens_per_step=10, steps=3, layers=2, exponent=1.0, drift=0.5)
    assert trace.shape == (3, 2, 16)
    assert trace.sum(dim=2).tolist() == [[40, 40]] * 3
    assert int(trace.max()) <= 10
    save_trace(trace, tmp_path / "trace.json")
    assert torch.equal(load_trace(tmp_path / "trace.json"), trace)


def test_simulator_balances_a_skewed_trace() -> None:
    trace = zipf_trace(32, 4, tokens_per_step=64, steps=40, layers=1, exponent=1.0)
    result = simulate(
        trace, SimConfig(num_ranks=8, num_redundant=8, interval_steps=20), StepCosts()
    )
    static, eplb = result["static"], result["eplb"]
    assert isinstance(static, dict) and isinstance(eplb, dict)
    assert static["interval_imbalance"] > 1.5
    assert eplb["interval_imbalance"] < 1.15
    assert eplb["moe_step_us"] < static["moe_step_us"]


def test_each_new_slot_takes_its_expert_from_itself_else_the_old_copies_in_turn() -> None:
    """sources (engine/expert_rebalance.py): where each slot of a new placement gets its
    weights when an expert-parallel group rebalances while serving."""
    old = ExpertParallel.contiguous(0, 2, 8)  # rank 0: 0-3, rank 1: 4-7
    slots = torch.tensor([[0, 1, 2, 3, 4], [5, 6, 7, 0, -1]])
    new = ExpertParallel(0, 2, slots, torch.ones(slots.shape, dtype=torch.float64))
    assert sources(old, new).tolist() == [[0, 0, 0, 0, 1], [1, 1, 1, 0, -1]]
    # Expert 0 held by ranks 0 and 2, copied twice to rank 3: once from each.
    held = torch.tensor([[0, 1], [2, 3], [0, 4], [5, 6]])
    old = ExpertParallel(0, 4, held, torch.ones(held.shape, dtype=torch.float64))
    slots = torch.tensor([[1, 2], [3, 4], [5, 6], [0, 0]])
    new = ExpertParallel(0, 4, slots, torch.ones(slots.shape, dtype=torch.float64))
    assert sources(old, new).tolist() == [[0, 1], [1, 2], [3, 3], [0, 2]]


def test_fill_to_level_places_every_expert_once_and_rebalance_starts_from_the_lower_peak() -> None:
    """32 ranks, 64 experts + 8 copies on a Zipf-skewed load: every expert's shares sum to one,
    no rank holds more slots than the width, and rebalance's peak is at most the lower of the
    two placements' (it starts from that one and the local search never raises it)."""
    load = zipf_trace(64, 4, 512, 20, exponent=0.5, seed=3).sum(dim=(0, 1)).double()
    filled = fill_to_level(list(range(64)), load, 72, 32)
    assert filled is not None
    held = filled.slots >= 0
    assert filled.slots.shape == (32, 3) and int(held.sum()) <= 72
    totals = torch.zeros(64, dtype=torch.float64).index_add_(
        0, filled.slots[held], filled.shares[held]
    )
    torch.testing.assert_close(totals, torch.ones(64, dtype=torch.float64))
    packed = replicate_and_pack(list(range(64)), load, 72, 32)
    chosen = rebalance(load, 32, 8, policy="global")
    peaks = [float(p.rank_loads(load).max()) for p in (packed, filled, chosen)]
    assert peaks[2] <= min(peaks[0], peaks[1])


def _expert_totals(placement: Placement, num_experts: int) -> torch.Tensor:
    held = placement.slots >= 0
    return torch.zeros(num_experts, dtype=torch.float64).index_add_(
        0, placement.slots[held], placement.shares[held]
    )


def test_repartition_finds_the_closest_split_of_two_ranks() -> None:
    """Rank 0 holds 7 + 4 + 4 = 15, rank 1 holds 6 + 3 = 9: no single move or swap evens
    them (the gap is 6; moving a 4 leaves 11 / 13, swapping 7 for 6 or 4 for 3 narrows it to
    4), splitting the five copies anew gives {7, 4} / {6, 4, 3} = 11 / 13, and no split does
    better; shares are untouched."""
    load = torch.tensor([7.0, 4, 4, 6, 3])
    placement = Placement.even(torch.tensor([[0, 1, 2], [3, 4, -1]]), 5)
    out = repartition(placement, load)
    assert sorted(out.rank_loads(load).tolist()) == [11.0, 13.0]
    assert (out.slots >= 0).sum(dim=1).tolist() in ([2, 3], [3, 2])
    torch.testing.assert_close(_expert_totals(out, 5), torch.ones(5, dtype=torch.float64))


def test_repartition_evens_a_zipf_placement_and_keeps_every_copy() -> None:
    """128 ranks of 3 slots from the greedy packing: the loads' sum of squares falls and the
    peak does not rise, every expert keeps its whole load, no rank holds more slots than
    before or two copies of one expert."""
    load = zipf_trace(256, 8, 2048, 20, exponent=0.5, seed=2).sum(dim=(0, 1)).double()
    packed = replicate_and_pack(list(range(256)), load, 288, 128)
    out = repartition(packed, load)
    before, after = packed.rank_loads(load), out.rank_loads(load)
    assert float(after.max()) <= float(before.max())
    assert float((after**2).sum()) < float((before**2).sum())
    assert out.slots.shape == packed.slots.shape
    assert int((out.slots >= 0).sum()) == int((packed.slots >= 0).sum())
    torch.testing.assert_close(_expert_totals(out, 256), torch.ones(256, dtype=torch.float64))
    for row in out.slots.tolist():
        held = [e for e in row if e >= 0]
        assert len(set(held)) == len(held)


def test_spend_slots_copies_the_peak_ranks_expert_onto_a_free_slot() -> None:
    """Expert 0 (load 6) alone on rank 0, experts 1 and 2 (2 each) on rank 1, one free slot
    of four: a copy of expert 0 on rank 1 with 5/6 and 1/6 of its tokens evens them."""
    load = torch.tensor([6.0, 2, 2])
    placement = Placement.even(torch.tensor([[0, -1, -1], [1, 2, -1]]), 3)
    out = spend_slots(placement, load, slots=4)
    assert out.rank_loads(load).tolist() == [5.0, 5.0]
    assert out.replicas(3).tolist() == [2, 1, 1]
    torch.testing.assert_close(_expert_totals(out, 3), torch.ones(3, dtype=torch.float64))
    # With no slot to spend and no copy to merge, nothing moves.
    assert torch.equal(spend_slots(placement, load, slots=3).slots, placement.slots)


def test_rebalance_at_128_ranks_stays_within_its_slots_and_levels_to_two_percent() -> None:
    """256 experts + 32 copies on 128 ranks (3 slots each at most), Zipf-skewed: balanced on
    the load it was computed from to within 2% (1.077 before repartition and spend_slots);
    every expert served in full, at most 288 copies."""
    load = zipf_trace(256, 8, 2048, 50, exponent=0.5, seed=0).sum(dim=(0, 1)).double()
    placement = rebalance(load, 128, 32, policy="global")
    assert imbalance(placement.rank_loads(load)) < 1.02
    assert int((placement.slots >= 0).sum()) <= 288 and placement.slots.shape[1] == 3
    torch.testing.assert_close(_expert_totals(placement, 256), torch.ones(256, dtype=torch.float64))
    levelled = float(level_shares(placement, load).rank_loads(load).max())
    assert levelled <= float(placement.rank_loads(load).max()) * (1 + 1e-9)


def test_step_costs_fit_the_expert_gemm_from_a_measurement() -> None:
    """moe.py gemm's JSON (benchmarks/moe/) from known constants (10 us fixed, 2 us per
    expert, 0.03 us per row, split over gate_up and down) gives them back; the all-to-all's stay."""
    shape = {"experts": 128, "top_k": 8, "hidden": 2048, "inter": 768}
    rows = []
    for tokens, hit in ((1, 8), (64, 126), (256, 128)):
        total = 10.0 + 2.0 * hit + 0.03 * tokens * 8
        rows.append(
            {
                "tokens": tokens,
                "active_experts": hit,
                "gate_up": {"grouped_us": 0.6 * total},
                "down": {"grouped_us": 0.4 * total},
            }
        )
    costs = StepCosts().from_gemm_measurement({"shape": shape, "rows": rows})
    assert costs.expert_bytes == 3 * 2048 * 768 * 2 and costs.row_bytes == 4096
    assert costs.gemm_fixed_us == pytest.approx(10.0)
    assert costs.expert_bytes / costs.hbm_bytes_per_us == pytest.approx(2.0)
    assert costs.us_per_row == pytest.approx(0.03)
    assert costs.link_bytes_per_us == StepCosts().link_bytes_per_us
    one_rank = costs.step_us(torch.tensor([[8.0]]), torch.tensor([[8.0]]))
    a2a = 2 * (costs.a2a_latency_us + 8 * 4096 / costs.link_bytes_per_us)
    assert float(one_rank) == pytest.approx(10.0 + 16.0 + 0.24 + a2a)
    with pytest.raises(ValueError, match="at least three"):
        StepCosts().from_gemm_measurement({"shape": shape, "rows": rows[:2]})


def test_load_served_joins_each_workers_parts_and_adds_the_workers(tmp_path: Path) -> None:
    trace = zipf_trace(8, 2, tokens_per_step=4, steps=6, layers=2, seed=5)
    save_trace(trace[:3], tmp_path / "decode-0.0-g0-0000.json")
    save_trace(trace[3:4], tmp_path / "decode-0.0-g0-0001.json")
    save_trace(trace[4:], tmp_path / "decode-0.0-g1-0000.json")  # restarted
    save_trace(2 * trace[:5], tmp_path / "decode-0.1-g0-0000.json")
    (tmp_path / "notes.txt").write_text("not a trace")
    served = load_served(tmp_path)
    assert torch.equal(served, 3 * trace[:5])  # rank 1 wrote 5 steps: the sum is cut there
    with pytest.raises(ValueError, match="no <worker id>-g<generation>-<part>"):
        load_served(tmp_path / "empty")


def test_step_costs_fit_the_all_to_all_from_a_measurement() -> None:
    """benchmarks/moe/ep_check.py's a2a.json made from 25 us + bytes at 100 GB/s gives both back."""
    rows = [
        {"rows": n, "hidden": h, "us": 25.0 + n * h * 2 / 1e5}
        for h in (2048, 7168)
        for n in (8, 256, 4096)
    ]
    costs = StepCosts().from_a2a_measurement({"world_size": 2, "rows": rows})
    assert costs.a2a_latency_us == pytest.approx(25.0)
    assert costs.link_bytes_per_us == pytest.approx(1e5)
    assert costs.expert_bytes == StepCosts().expert_bytes
    with pytest.raises(ValueError, match="at least two sizes"):
        StepCosts().from_a2a_measurement({"rows": rows[:1]})


def test_three_equal_experts_on_four_ranks_with_three_copies_are_even() -> None:
    """6 copies of three experts of 7 on 4 ranks reach 5.25 a rank (a review found a pour
    rule that left 7 here)."""
    load = torch.tensor([7.0, 7, 7])
    placement = rebalance(load, 4, 3, policy="global")
    assert placement.rank_loads(load).max() == pytest.approx(5.25)
