"""Prometheus metrics of the service, defined in one place.

Each server owns a private registry (so that tests can build several apps in one process).
Every series carries ``model_name`` and the ``pool`` / ``worker`` it belongs to, so that one
scrape of the API server's /metrics sees the whole deployment. Worker-side numbers (running,
waiting, KV blocks, transfers, prefix cache; a vision worker's images encoded, encoder cache
hits and encode times) arrive as WorkerStats messages; request-side
numbers are measured by the API server and labelled with the worker that did the work:
the prompt's (TTFT, queue and prefill time, prompt tokens) or the answer's (the rest).
Series of the API server itself (admission, refusals before routing) use pool="api".
"""

from __future__ import annotations

from contextlib import suppress

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
API_POOL = "api"
LABELS = ("model_name", "pool", "worker")
WORKER_STATES = ("starting", "ready", "unhealthy", "draining")
DEVICE_TIER = "device"
_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5)


class Metrics:
    def __init__(self, model_name: str) -> None:
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

        self.num_requests_running = gauge("num_requests_running", "Sequences in engine batches")
        self.num_requests_waiting = gauge("num_requests_waiting", "Sequences waiting in engines")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Used KV blocks, 0..1")
        self.kv_cache_free_blocks = gauge("kv_cache_free_blocks", "Free KV blocks")
        self.kv_cache_total_blocks = gauge("kv_cache_total_blocks", "KV blocks")
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
        self.kv_transfer_bytes = counter(
            "kv_transfer_bytes", "KV bytes a worker sent (prefill) or received (decode)"
        )
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
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Duration of one request's KV transfer", _TRANSFER_BUCKETS
        )
        self.worker_loop_seconds = counter(
            "worker_loop_seconds",
            "Seconds of a worker's loop by phase (engine: schedule, forward, wait, outputs; "
            "worker: idle, receive, reserve, adopt, handoff, worker, send, stats)",
            ("phase",),
        )
        self.worker_loop_steps = counter("worker_loop_steps", "Engine steps a worker took")
        self.eplb_rebalances = counter(
            "eplb_rebalances", "Expert rebalances of the rank's expert-parallel group"
        )
        self.eplb_imbalance = gauge(
            "eplb_imbalance",
            "Rank load max/mean of the group's last EPLB interval, before its rebalance",
        )
        self.spec_decode_num_drafts = counter(
            "spec_decode_num_drafts", "Speculative steps of a request (drafts verified)"
        )
        self.spec_decode_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Draft tokens verified"
        )
        self.spec_decode_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Draft tokens accepted"
        )
        self.spec_decode_num_accepted_tokens_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted, by position in the draft (0: the first)",
            ("position",),
        )
        self.images_encoded = counter("images_encoded", "Images a vision worker ran its encoder on")
        self.encoder_cache_hits = counter(
            "encoder_cache_hits", "Images a vision worker took from its encoder cache"
        )
        self.image_encode_seconds = histogram(
            "image_encode_seconds", "Duration of one vision encoder run", _TRANSFER_BUCKETS
        )

    def labels(self, pool: str, worker: str) -> tuple[str, str, str]:
        return (self.model_name, pool, worker)

    def observe_stats(self, pool: str, stats: WorkerStats, previous: WorkerStats | None) -> None:
        """A worker's gauges from its latest stats; its counters grow by the change since
        ``previous`` (its stats before, None for the first)."""
        key = self.labels(pool, stats.worker_id)
        self.num_requests_running.labels(*key).set(stats.num_running)
        self.num_requests_waiting.labels(*key).set(stats.num_waiting)
        self.kv_cache_free_blocks.labels(*key).set(stats.num_free_blocks)
        self.kv_cache_total_blocks.labels(*key).set(stats.num_total_blocks)
        self.kv_cache_usage_perc.labels(*key).set(stats.kv_usage)
        for seconds in stats.kv_transfer_seconds:
            self.kv_transfer_seconds.labels(*key).observe(seconds)
        before = previous or WorkerStats(stats.worker_id, 0, 0, 0, 0, 0.0, 0, 0)
        self.kv_transfer_bytes.labels(*key).inc(
            max(stats.kv_transfer_bytes - before.kv_transfer_bytes, 0)
        )
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
        self.worker_loop_steps.labels(*key).inc(max(stats.loop_steps - before.loop_steps, 0))
        if stats.eplb_rebalances:
            rebalances = max(stats.eplb_rebalances - before.eplb_rebalances, 0)
            self.eplb_rebalances.labels(*key).inc(rebalances)
            self.eplb_imbalance.labels(*key).set(stats.eplb_imbalance)
        self._observe_spec(key, stats, before)
        earlier = {p.phase: p.seconds for p in before.loop_phases}
        for phase in stats.loop_phases:
            grown = max(phase.seconds - earlier.get(phase.phase, 0.0), 0.0)
            self.worker_loop_seconds.labels(*key, phase.phase).inc(grown)

    def _observe_spec(
        self, key: tuple[str, str, str], stats: WorkerStats, before: WorkerStats
    ) -> None:
        for metric, now, then in (
            (self.spec_decode_num_drafts, stats.spec_num_drafts, before.spec_num_drafts),
            (
                self.spec_decode_num_draft_tokens,
                stats.spec_num_draft_tokens,
                before.spec_num_draft_tokens,
            ),
            (
                self.spec_decode_num_accepted_tokens,
                stats.spec_num_accepted_tokens,
                before.spec_num_accepted_tokens,
            ),
        ):
            if now or then:
                metric.labels(*key).inc(max(now - then, 0))
        earlier = before.spec_accepted_per_pos
        for pos, count in enumerate(stats.spec_accepted_per_pos):
            grown = count - (earlier[pos] if pos < len(earlier) else 0)
            per_pos = self.spec_decode_num_accepted_tokens_per_pos
            per_pos.labels(*key, str(pos)).inc(max(grown, 0))

    def observe_vision_stats(
        self, pool: str, stats: WorkerStats, previous: WorkerStats | None
    ) -> None:
        """A vision worker's counters grow by the change since ``previous``."""
        key = self.labels(pool, stats.worker_id)
        before = previous or WorkerStats(stats.worker_id, 0, 0, 0, 0, 0.0, 0, 0)
        self.num_requests_waiting.labels(*key).set(stats.num_running)
        self.images_encoded.labels(*key).inc(max(stats.images_encoded - before.images_encoded, 0))
        hits = max(stats.encoder_cache_hits - before.encoder_cache_hits, 0)
        self.encoder_cache_hits.labels(*key).inc(hits)
        for seconds in stats.encode_seconds:
            self.image_encode_seconds.labels(*key).observe(seconds)

    def forget_worker(self, pool: str, worker: str) -> None:
        """Drop a removed worker's gauges, so that they do not show its last values forever."""
        key = self.labels(pool, worker)
        for gauge in (
            self.num_requests_running,
            self.num_requests_waiting,
            self.kv_cache_free_blocks,
            self.kv_cache_total_blocks,
            self.kv_cache_usage_perc,
        ):
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
