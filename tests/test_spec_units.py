"""Speculative decoding's parts on their own: the n-gram lookup, the block rollback, the
draft planner and the config."""

from __future__ import annotations

import pytest

from splitserve.config import ConfigError, load_config
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec.config import SpeculativeConfig
from splitserve.engine.spec.dynamic import Acceptance, StepCost, plan_drafts
from splitserve.engine.spec.ngram import lookup
from splitserve.services.messages import WorkerStats
from splitserve.services.metrics import Metrics


def test_ngram_lookup_follows_the_latest_match_of_the_longest_suffix() -> None:
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 7, 2, 3]
    assert lookup(tokens, 1, 3, 4) == [4, 5, 7, 2]  # "2 3" last seen before 4 5 7 2
    assert lookup(tokens, 1, 3, 2) == [4, 5]
    assert lookup([5, 6, 7, 5, 6], 2, 2, 8) == [7, 5, 6]  # the draft may run to the end
    assert lookup([1, 2, 3, 4], 1, 3, 4) == []
    assert lookup([8, 1, 2, 8], 2, 3, 4) == []  # a one-token match is below prompt_lookup_min
    assert lookup([8, 1, 2, 8], 1, 3, 4) == [1, 2, 8]


def test_trim_returns_the_tail_blocks_of_rejected_drafts() -> None:
    manager = BlockManager(8, 4, True, 0)
    req = Request("a", list(range(10)), SamplingParams())
    assert manager.allocate_slots(req, 10 + 6)  # ten tokens and six drafts: four blocks
    assert req.block_table == [0, 1, 2, 3]
    manager.trim(req, 11)
    assert req.block_table == [0, 1, 2]
    assert list(manager.free_queue) == [4, 5, 6, 7, 3]
    manager.trim(req, 12)
    assert req.block_table == [0, 1, 2]


def _cost(per_token: float) -> StepCost:
    """A fit of steps costing 10 ms plus per_token each, and 1 ms per draft pass."""
    cost = StepCost()
    for tokens, passes in ((1, 0), (4, 1), (9, 1), (32, 0), (64, 0), (40, 1)):
        cost.record(tokens, passes, 0.010 + per_token * tokens + 0.001 * passes)
    return cost


def test_a_memory_bound_batch_verifies_every_draft_worth_it() -> None:
    cost = _cost(per_token=0.00001)
    assert plan_drafts([0.9, 0.9], 4, cost, lambda limits: int(any(limits))) == [4, 4]
    # Drafts of a request whose drafts are never accepted are worth nothing.
    assert plan_drafts([0.9, 0.0], 4, cost, lambda limits: int(any(limits))) == [4, 0]


def test_a_compute_bound_batch_verifies_none() -> None:
    cost = _cost(per_token=0.002)
    assert plan_drafts([0.6] * 32, 4, cost, lambda limits: int(any(limits))) == [0] * 32


def test_draft_length_follows_acceptance_against_the_cost_of_a_pass() -> None:
    cost = StepCost()
    for tokens, passes in ((1, 0), (4, 3), (9, 2), (2, 1), (30, 0), (5, 4), (12, 1)):
        cost.record(tokens, passes, 0.010 + 0.0001 * tokens + 0.001 * passes)
    assert cost.coefficients()[2] == pytest.approx(0.001, rel=0.05)
    assert plan_drafts([0.8], 4, cost, max) == [4]
    assert plan_drafts([0.3], 4, cost, max) == [1]


def test_acceptance_falls_with_rejections_and_returns_to_its_prior_when_idle() -> None:
    rate = Acceptance()
    assert rate.rate == pytest.approx(0.6)
    for _ in range(10):
        rate.record(4, 0)
    low = rate.rate
    assert low < 0.15
    for _ in range(30):
        rate.idle()
    assert rate.rate > 0.5


def test_speculative_config_reads_vllm_keys_and_names_an_unknown_one() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    )
    assert (config.num_speculative_tokens, config.prompt_lookup_min, config.dynamic) == (3, 2, True)
    with pytest.raises(ValueError, match="unknown speculative_config key 'lookahead'"):
        SpeculativeConfig.from_dict({"lookahead": 3})
    with pytest.raises(ValueError, match="needs `model`"):
        SpeculativeConfig(method="draft_model")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpeculativeConfig(num_speculative_tokens=0)


def test_a_pool_speculative_section_reaches_its_engine_config() -> None:
    config = load_config(
        None,
        ["pools.decode.speculative.method=ngram", "pools.decode.speculative.prompt_lookup_max=4"],
    )
    assert config.pools["decode"].engine.speculative == SpeculativeConfig(prompt_lookup_max=4)
    assert config.pools["prefill"].engine.speculative is None
    with pytest.raises(ConfigError, match="not 'prefill' ones"):
        load_config(None, ["pools.prefill.speculative.method=ngram"])
    with pytest.raises(ConfigError, match=r"engine\.speculative cannot be set"):
        load_config(None, ["pools.decode.engine.speculative.method=ngram"])


def test_spec_decode_counters_grow_by_the_change_between_stats() -> None:
    metrics = Metrics("m")
    before = WorkerStats(worker_id="w", spec_num_drafts=2, spec_accepted_per_pos=[1])
    after = WorkerStats(
        worker_id="w", spec_num_drafts=5, spec_num_draft_tokens=12,
        spec_num_accepted_tokens=7, spec_accepted_per_pos=[4, 3],
    )  # fmt: skip
    metrics.observe_stats("decode", before, None)
    metrics.observe_stats("decode", after, before)
    text = metrics.render().decode()
    labels = 'model_name="m",pool="decode",worker="w"'
    assert f"splitserve:spec_decode_num_drafts_total{{{labels}}} 5.0" in text
    assert f"splitserve:spec_decode_num_draft_tokens_total{{{labels}}} 12.0" in text
    assert f"splitserve:spec_decode_num_accepted_tokens_total{{{labels}}} 7.0" in text
    per_pos = "splitserve:spec_decode_num_accepted_tokens_per_pos_total"
    at = 'model_name="m",pool="decode",position="{}",worker="w"'
    assert f"{per_pos}{{{at.format(0)}}} 4.0" in text
    assert f"{per_pos}{{{at.format(1)}}} 3.0" in text


def test_overlapped_plain_steps_reach_the_cost_fit_and_stop_unpaying_drafts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps without drafts run overlapped and never reach ``verify``; their launch-to-launch
    time is what the planner must weigh drafts against (on an H200 a plain step was several
    times cheaper than a synchronous verify step, and dynamic mode ran at 0.49x of plain)."""
    from splitserve.engine.spec import speculator as module
    from splitserve.engine.spec.ngram import NgramDrafter

    spec = module.Speculator(SpeculativeConfig(num_speculative_tokens=4), NgramDrafter(1, 3), 512)
    for tokens, passes in ((20, 1), (24, 1), (40, 1), (36, 1), (60, 1)):
        spec.cost.record(tokens, passes, 0.030)  # synchronous verify steps: 30 ms each
    clock = iter([1.000, 1.005, 1.010, 1.015, 5.000, 5.005])
    monkeypatch.setattr(module.time, "perf_counter", lambda: next(clock))
    for _ in range(4):
        spec.overlapped(16)  # three 5 ms plain steps recorded (the first only starts the clock)
    spec.idle()
    spec.overlapped(16)  # after an idle gap: not a step's time (4 s)
    spec.overlapped(16)
    assert spec.cost.plain_weight > 3.5  # four plain steps, decayed
    base, per_token, per_pass = spec.cost.coefficients()
    assert base + per_token * 16 == pytest.approx(0.005, rel=0.3)
    assert per_pass > 0.015
    # Sixteen requests whose drafts are accepted 80% of the time: still not worth a verify pass
    # that costs five plain steps.
    assert plan_drafts([0.8] * 16, 4, spec.cost, lambda limits: int(any(limits))) == [0] * 16


def test_a_request_whose_lookups_find_nothing_stops_being_asked_for_drafts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Asking for drafts costs the step its overlap (the step in flight is read first). When
    the lookup finds nothing, the request's rate falls as for rejected drafts, so after a few
    tries it is asked only now and then, and the next overlapped step is charged to a pass."""
    from splitserve.engine.spec import speculator as module
    from splitserve.engine.spec.ngram import NgramDrafter

    spec = module.Speculator(SpeculativeConfig(num_speculative_tokens=4), NgramDrafter(2, 3), 512)
    for _ in range(4):  # verify steps: 7 ms; overlapped plain steps: 5 ms
        spec.cost.record(5, 1, 0.007)
        spec.cost.record(1, 0, 0.005)
    req = Request("r", list(range(10, 40)), SamplingParams(max_tokens=100))  # no repeats
    req.num_computed_tokens = req.num_tokens - 1
    asked = []
    for _ in range(40):
        asked.append(spec.limits([req]) != [0])
        spec.propose([req])
        assert req.draft_token_ids == []
    assert asked[0]
    assert sum(asked[10:]) <= 4  # retried now and then, as its rate drifts back when idle

    recorded = []
    monkeypatch.setattr(spec.cost, "record", lambda *point: recorded.append(point))
    monkeypatch.setattr(module.time, "perf_counter", iter([1.0, 1.001, 1.009, 1.014]).__next__)
    fresh = Request("s", list(range(50, 80)), SamplingParams(max_tokens=100))
    fresh.num_computed_tokens = fresh.num_tokens - 1
    spec.overlapped(1)  # the launch before propose() read it back
    spec.propose([fresh])  # asked at the prior rate, found nothing
    spec.overlapped(1)  # charged to a pass
    spec.overlapped(1)  # a plain overlapped step again
    assert recorded == [(1, 1, pytest.approx(0.009)), (1, 0, pytest.approx(0.005))]


def test_drafts_keep_a_step_within_the_rows_of_the_measured_path() -> None:
    """Past max_rows a CPU step leaves the native decode path (it dequantizes the weights),
    where the linear cost fit does not hold: the plan stays below it."""
    cost = StepCost()
    for tokens in range(1, 40):
        cost.record(tokens, 0, 0.050 + 0.0001 * tokens)  # memory-bound: drafts nearly free
    assert sum(plan_drafts([0.9] * 32, 6, cost, max)) > 16
    assert sum(plan_drafts([0.9] * 32, 6, cost, max, max_rows=48)) == 16
