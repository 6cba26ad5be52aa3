"""Prometheus metrics of the service, defined in one place.

Each server owns a private registry (so that tests can build several apps in one process).
Every series carries ``model_name`` and the ``pool`` / ``worker`` it belongs to, so that one
scrape of the API server's /metrics sees the whole deployment. Worker-side numbers (running,
waiting, KV blocks, transfers, prefix cache; a vision worker's images encoded, encoder cache
hits and encode times) arrive as WorkerStats messages; request-side
numbers are measured by the API server and labelled with the worker that did the work:
the prompt's (TTFT, queue and prefill time, prompt tokens) or the answer's (the rest).
Series of the API server itself (admission, refusals before routing) use pool="api".

The worker-side series are not written out here: each comes from the ``stat`` of its field in
WorkerStats (engine/stats.py declares the engine's, services/messages.py the worker's own), so
a statistic added there appears on the wire and in /metrics. The prefix cache's queries and
hits by tier are derived here from several of those fields.
"""

from __future__ import annotations

from contextlib import suppress
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from splitserve.engine.stats import ENGINE, GAUGE, HISTOGRAM, VISION, Stat, declared
from splitserve.services.messages import PhaseSeconds, WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()
API_POOL = "api"
LABELS = ("model_name", "pool", "worker")
WORKER_STATES = ("starting", "ready", "unhealthy", "draining")
DEVICE_TIER = "device"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    """schema: the workers' statistics (their ``stat`` declares each one's series)."""

    def __init__(self, model_name: str, schema: type[WorkerStats] = WorkerStats) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        reg = self.registry

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"splitserve:{name}", doc, LABELS, registry=reg)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"splitserve:{name}", doc, [*LABELS, *extra], registry=reg)

        def histogram(
            name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(f"splitserve:{name}", doc, LABELS, buckets=buckets, registry=reg)

        self.num_requests_admitted = gauge(
            "num_requests_admitted", "Engine requests admitted by the API server, not finished"
        )
        self.num_workers = Gauge(
            "splitserve:num_workers",
            "Workers by pool and state (starting, ready, unhealthy, draining)",
            ["model_name", "pool", "state"],
            registry=reg,
        )
        self.expert_group_ranks = Gauge(
            "splitserve:expert_group_ranks",
            "Ranks of an expert-parallel group by state (a group serves only with every rank "
            "ready)",
            ["model_name", "pool", "group", "state"],
            registry=reg,
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter(
            "request_success", "Finished engine requests", ("finished_reason",)
        )
        self.request_failure = counter(
            "request_failure", "Engine requests that failed or were refused", ("reason",)
        )
        self.request_migrations = counter(
            "request_migrations",
            "Engine requests moved off a worker that stopped (the worker it left)",
            ("reason",),
        )
        self.worker_restarts = counter("worker_restarts", "Workers restarted after they stopped")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", ("tier",)
        )
        self.prefix_cache_hits = counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache", ("tier",)
        )
        self.rejected_messages = counter(
            "rejected_messages",
            "Internal messages dropped unread: their HMAC is missing or wrong",
        )
        self.prefix_lookup_timeouts = counter(
            "prefix_lookup_timeouts",
            "Requests routed by load alone: the prefix index did not answer in time",
        )
        self.prefix_index_malformed = counter(
            "prefix_index_malformed",
            "Malformed prefix index entries that lookups skipped (a value that is not a time, "
            "a key that is not a hash)",
        )
        self.router_decisions = Counter(
            "splitserve:router_decisions",
            "Routing decisions, by policy and stage (prefill, decode)",
            ["model_name", "policy", "stage"],
            registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from admission to the first token"
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between two tokens of a request", _TOKEN_BUCKETS
        )
        self.request_time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time divided by the tokens after the first",
            _TOKEN_BUCKETS,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from admission to the last token"
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Time from admission until the prompt is sent to the worker that computes it",
        )
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "Time from sending the prompt to the first token"
        )
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "Time from the first token to the last"
        )
        self.stats = declared(schema)
        self.worker_series = {
            name: series(name, how, reg) for name, how in self.stats if how.kind is not None
        }
        """A series per statistic that has one (field name -> series)."""

    def labels(self, pool: str, worker: str) -> tuple[str, str, str]:
        return (self.model_name, pool, worker)

    def observe_stats(self, pool: str, stats: WorkerStats, previous: WorkerStats | None) -> None:
        """An engine worker's gauges from its latest stats; its counters grow by the change
        since ``previous`` (its stats before, None for the first)."""
        key = self.labels(pool, stats.worker_id)
        before = previous or type(stats)()
        self._observe(key, stats, before, ENGINE)
        cached = max(stats.prompt_tokens_cached - before.prompt_tokens_cached, 0)
        computed = max(stats.prompt_tokens_computed - before.prompt_tokens_computed, 0)
        self.prefix_cache_queries.labels(*key, DEVICE_TIER).inc(cached + computed)
        host = max(stats.cached_host_tokens - before.cached_host_tokens, 0)
        disk = max(stats.cached_disk_tokens - before.cached_disk_tokens, 0)
        remote = max(stats.cached_remote_tokens - before.cached_remote_tokens, 0)
        device = max(cached - host - disk - remote, 0)
        self.prefix_cache_hits.labels(*key, DEVICE_TIER).inc(device)
        self.prefix_cache_hits.labels(*key, "host").inc(host)
        self.prefix_cache_hits.labels(*key, "disk").inc(disk)
        self.prefix_cache_hits.labels(*key, "remote").inc(remote)

    def observe_vision_stats(
        self, pool: str, stats: WorkerStats, previous: WorkerStats | None
    ) -> None:
        """A vision worker's counters grow by the change since ``previous``; its images in
        work (``num_running``) are its waiting requests."""
        key = self.labels(pool, stats.worker_id)
        waiting = self.worker_series["num_waiting"]
        assert isinstance(waiting, Gauge)
        waiting.labels(*key).set(stats.num_running)
        self._observe(key, stats, previous or type(stats)(), VISION)

    def _observe(
        self, key: tuple[str, str, str], stats: WorkerStats, before: WorkerStats, source: str
    ) -> None:
        """The series of the statistics that ``source`` workers report."""
        for name, how in self.stats:
            if how.kind is None or how.source != source:
                continue
            now, then = getattr(stats, name), getattr(before, name)
            if how.sparse and not (now or then):
                continue
            metric = self.worker_series[name]
            if isinstance(metric, Gauge):
                metric.labels(*key).set(now)
            elif isinstance(metric, Histogram):
                for value in now:
                    metric.labels(*key).observe(value)
            elif how.label:
                earlier = totals(then)
                for label, total in totals(now).items():
                    metric.labels(*key, label).inc(max(total - earlier.get(label, 0), 0))
            else:
                metric.labels(*key).inc(max(now - then, 0))

    def forget_worker(self, pool: str, worker: str) -> None:
        """Drop a removed worker's gauges, so that they do not show its last values forever."""
        key = self.labels(pool, worker)
        for gauge in self.worker_series.values():
            if isinstance(gauge, Gauge):
                with suppress(KeyError):
                    gauge.remove(*key)

    def set_num_workers(self, counts: dict[str, dict[str, int]]) -> None:
        """counts: pool -> state -> number of workers; states absent from it read 0."""
        for pool, states in counts.items():
            for state in WORKER_STATES:
                self.num_workers.labels(self.model_name, pool, state).set(states.get(state, 0))

    def set_group_ranks(self, counts: dict[tuple[str, str], dict[str, int]]) -> None:
        """counts: (pool, expert-parallel group) -> state -> ranks; absent states read 0."""
        for (pool, group), states in counts.items():
            for state in WORKER_STATES:
                labels = (self.model_name, pool, group, state)
                self.expert_group_ranks.labels(*labels).set(states.get(state, 0))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def series(name: str, how: Stat, registry: CollectorRegistry) -> Gauge | Counter | Histogram:
    """The Prometheus series of one statistic: ``splitserve:<metric>``, labelled by model,
    pool and worker (and the statistic's own label)."""
    labels = [*LABELS, how.label] if how.label else list(LABELS)
    metric = f"splitserve:{how.metric or name}"
    if how.kind == GAUGE:
        return Gauge(metric, how.help, labels, registry=registry)
    if how.kind == HISTOGRAM:
        buckets = how.buckets or _LATENCY_BUCKETS
        return Histogram(metric, how.help, labels, buckets=buckets, registry=registry)
    return Counter(metric, how.help, labels, registry=registry)


def totals(values: list[Any]) -> dict[str, float]:
    """A labelled counter's running totals by label: by position in the list, or by phase
    (``PhaseSeconds``)."""
    return dict(
        (value.phase, value.seconds) if isinstance(value, PhaseSeconds) else (str(i), value)
        for i, value in enumerate(values)
    )
