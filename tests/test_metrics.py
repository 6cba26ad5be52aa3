"""Metrics: worker stats become per-worker series; counters grow by the change since the last."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from splitserve.engine.stats import COUNTER, GAUGE, stat
from splitserve.services import wire
from splitserve.services.messages import PhaseSeconds, WorkerStats, decode, encode
from splitserve.services.metrics import Metrics


def samples(metrics: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for s in family.samples
    }


def labels(**extra: str) -> tuple[tuple[str, str], ...]:
    return tuple(
        sorted({"model_name": "m", "pool": "prefill", "worker": "prefill-0", **extra}.items())
    )


def stats(computed: int, cached: int, sent: int) -> WorkerStats:
    return WorkerStats(
        worker_id="prefill-0",
        num_running=2,
        num_waiting=1,
        num_free_blocks=30,
        num_total_blocks=40,
        kv_usage=0.25,
        prompt_tokens_computed=computed,
        prompt_tokens_cached=cached,
        kv_transfer_bytes=sent,
        kv_transfer_seconds=[0.004],
    )


def test_worker_stats_set_gauges_and_counters_grow_by_the_difference() -> None:
    metrics = Metrics("m")
    first = stats(computed=100, cached=0, sent=1000)
    metrics.observe_stats("prefill", first, None)
    metrics.observe_stats("prefill", stats(computed=140, cached=32, sent=1600), first)
    got = samples(metrics)
    assert got[("splitserve:num_requests_running", labels())] == 2
    assert got[("splitserve:num_requests_waiting", labels())] == 1
    assert got[("splitserve:kv_cache_usage_perc", labels())] == 0.25
    assert got[("splitserve:kv_transfer_bytes_total", labels())] == 1600
    assert got[("splitserve:kv_transfer_seconds_count", labels())] == 2
    assert got[("splitserve:prefix_cache_queries_total", labels(tier="device"))] == 172
    assert got[("splitserve:prefix_cache_hits_total", labels(tier="device"))] == 32


def test_a_forgotten_worker_has_no_gauges_and_num_workers_counts_every_state() -> None:
    metrics = Metrics("m")
    metrics.observe_stats("prefill", stats(0, 0, 0), None)
    metrics.forget_worker("prefill", "prefill-0")
    metrics.set_num_workers({"prefill": {"ready": 1, "draining": 1}})
    got = samples(metrics)
    assert ("splitserve:num_requests_running", labels()) not in got
    workers = {
        dict(key)["state"]: value
        for (name, key), value in got.items()
        if name == "splitserve:num_workers"
    }
    assert workers == {"starting": 0, "ready": 1, "unhealthy": 0, "draining": 1}


def test_loop_phases_become_seconds_per_phase_and_steps_counters() -> None:
    metrics = Metrics("m")

    def timed(steps: int, forward: float, send: float) -> WorkerStats:
        phases = [PhaseSeconds("forward", forward), PhaseSeconds("send", send)]
        return WorkerStats(worker_id="prefill-0", loop_phases=phases, loop_steps=steps)

    first = timed(steps=10, forward=0.5, send=0.25)
    metrics.observe_stats("prefill", first, None)
    metrics.observe_stats("prefill", timed(steps=30, forward=1.5, send=0.5), first)
    got = samples(metrics)
    assert got[("splitserve:worker_loop_steps_total", labels())] == 30
    assert got[("splitserve:worker_loop_seconds_total", labels(phase="forward"))] == 1.5
    assert got[("splitserve:worker_loop_seconds_total", labels(phase="send"))] == 0.5


@dataclass(frozen=True)
class WithWidgets(WorkerStats):
    """A worker statistic declared in one place, as a new one would be."""

    widgets: int = stat("Widgets a worker made", COUNTER)
    widget_temperature: float = stat("The last widget's temperature", GAUGE, 0.0)


def test_a_statistic_declared_once_is_in_the_message_codec_and_in_metrics() -> None:
    first = WithWidgets(worker_id="prefill-0", widgets=3, widget_temperature=21.5)
    later = WithWidgets(worker_id="prefill-0", widgets=10, widget_temperature=22.0)
    body = wire.encoder(WithWidgets)(later)
    assert body[-2:] == [10, 22.0]
    assert wire.decoder(WithWidgets)(body) == later
    metrics = Metrics("m", WithWidgets)
    metrics.observe_stats("prefill", first, None)
    metrics.observe_stats("prefill", later, first)
    got = samples(metrics)
    assert got[("splitserve:widgets_total", labels())] == 10
    assert got[("splitserve:widget_temperature", labels())] == 22.0
    assert "# HELP splitserve:widgets_total Widgets a worker made" in metrics.render().decode()


def test_an_engine_statistic_reaches_metrics_through_the_wire() -> None:
    sent = WorkerStats(worker_id="prefill-0", num_running=7, spec_num_accepted_tokens=4)
    received = decode(encode(sent))
    assert isinstance(received, WorkerStats)
    metrics = Metrics("m")
    metrics.observe_stats("prefill", received, None)
    text = metrics.render().decode()
    assert (
        'splitserve:num_requests_running{model_name="m",pool="prefill",worker="prefill-0"} 7.0'
        in text
    )
    assert "# HELP splitserve:num_requests_running Sequences in engine batches" in text
    got = samples(metrics)
    assert got[("splitserve:spec_decode_num_accepted_tokens_total", labels())] == 4
    assert ("splitserve:eplb_rebalances_total", labels()) not in got  # sparse: never nonzero
