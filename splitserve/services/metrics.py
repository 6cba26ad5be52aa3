"""Prometheus metrics of the service, defined in one place.

Each server owns a private registry (so that tests can build several apps in one process).
Worker-side numbers (running, waiting, KV blocks) arrive as WorkerStats messages and are
summed over the workers; request-side numbers are counted by the API server.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from splitserve.services.messages import WorkerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
disable_created_metrics()
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(f"splitserve:{name}", doc, labels, registry=self.registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"splitserve:{name}", doc, [*labels, *extra], registry=self.registry)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                f"splitserve:{name}", doc, labels, buckets=_LATENCY_BUCKETS, registry=self.registry
            )

        self.num_requests_running = gauge("num_requests_running", "Sequences in engine batches")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting in engines")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Used KV blocks, 0..1")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "Free KV blocks, all workers")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV blocks, all workers")
        self.num_workers_ready = gauge("num_workers_ready", "Workers with a recent heartbeat")
        self.num_requests_admitted = gauge(
            "num_requests_admitted", "Engine requests admitted by the API server"
        )
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.prefix_cache_hits = counter("prefix_cache_hit_tokens", "Prompt tokens served from KV")
        self.request_success = counter(
            "request_success", "Finished engine requests", ("finished_reason",)
        )
        self.requests_rejected = counter("requests_rejected", "Requests refused", ("reason",))
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from admission to the first token"
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from admission to the last token"
        )
        worker = [*labels, "worker"]
        self.worker_free_blocks = Gauge(
            "splitserve:worker_kv_cache_free_blocks",
            "Free KV blocks per worker",
            worker,
            registry=self.registry,
        )
        self.kv_transfer_bytes = Counter(
            "splitserve:kv_transfer_bytes",
            "KV bytes a worker sent (prefill) or received (decode)",
            worker,
            registry=self.registry,
        )
        self.kv_transfer_seconds = Histogram(
            "splitserve:kv_transfer_seconds",
            "Duration of one request's KV transfer, per worker",
            worker,
            buckets=_TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.model_name = model_name

    def observe_transfers(self, stats: WorkerStats, new_bytes: int) -> None:
        """Count a worker's KV bytes since its previous stats and its finished transfers."""
        m, w = self.model_name, stats.worker_id
        self.worker_free_blocks.labels(m, w).set(stats.num_free_blocks)
        self.kv_transfer_bytes.labels(m, w).inc(max(new_bytes, 0))
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_seconds.labels(m, w).observe(seconds)

    def set_worker_stats(self, stats: Iterable[WorkerStats]) -> None:
        """Replace the worker gauges with the sums over the latest stats of each worker."""
        items = list(stats)
        free = sum(s.num_free_blocks for s in items)
        total = sum(s.num_total_blocks for s in items)
        m = self.model_name
        self.num_requests_running.labels(m).set(sum(s.num_running for s in items))
        self.num_requests_waiting.labels(m).set(sum(s.num_waiting for s in items))
        self.kv_cache_free_blocks.labels(m).set(free)
        self.kv_cache_total_blocks.labels(m).set(total)
        self.kv_cache_usage_perc.labels(m).set(1.0 - free / total if total else 0.0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
