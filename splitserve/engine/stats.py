"""A worker's statistics, each declared once: its name and type as a field here, its help text
and Prometheus form (gauge, counter, histogram; metric name, labels) in the field's ``stat``.

The engine fills ``EngineStats``; the ``WorkerStats`` message (services/messages.py) derives
from it and adds the worker's own statistics the same way. Everything else is derived from
these fields: the message's msgpack codec (services/wire.py reads the fields) and the
Prometheus series with their updates (services/metrics.py reads the ``stat`` of each).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # this module imports without torch: the messages import it
    from splitserve.engine.block_manager import BlockManager
    from splitserve.engine.scheduler import Scheduler
    from splitserve.engine.spec.speculator import SpecCounters

GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
ENGINE, VISION = "engine", "vision"
TIERS = ("device", "host", "disk", "remote")
"""Where a cached prompt token came from (remote: pulled from another prefill worker)."""


@dataclass(frozen=True)
class Stat:
    """How one statistic is exported. A counter's value is a running total since the worker
    started (the series grows by the change between two reports); a histogram's is the list of
    observations since the last report; a counter with a label is a list of running totals,
    by position (label = the index) or of (label, total) records."""

    help: str
    kind: str | None = None
    """GAUGE, COUNTER or HISTOGRAM; None: no series of its own (a derived one reads it)."""
    metric: str = ""
    """The series' name after ``splitserve:`` (default: the field's name)."""
    label: str = ""
    buckets: tuple[float, ...] = ()
    sparse: bool = False
    """The series appears once the statistic is not zero (features most workers lack)."""
    source: str = ENGINE
    """Which workers report it: ENGINE (every engine worker) or VISION (a vision worker)."""


def stat(help: str, kind: str | None = None, default: Any = 0, **how: Any) -> Any:
    """The dataclass field of a statistic (lists start empty)."""
    meta = {"stat": Stat(help, kind, **how)}
    if isinstance(default, list):
        return dataclasses.field(default_factory=list, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def declared(cls: type) -> list[tuple[str, Stat]]:
    """(field name, its Stat) for each statistic of a stats dataclass, in field order."""
    return [(f.name, f.metadata["stat"]) for f in dataclasses.fields(cls) if "stat" in f.metadata]


@dataclass(frozen=True)
class EngineStats:
    """An engine's counters and gauges at one moment (counters: since it started)."""

    num_running: int = stat("Sequences in engine batches", GAUGE, metric="num_requests_running")
    num_waiting: int = stat("Sequences waiting in engines", GAUGE, metric="num_requests_waiting")
    num_free_blocks: int = stat("Free KV blocks", GAUGE, metric="kv_cache_free_blocks")
    num_total_blocks: int = stat("KV blocks", GAUGE, metric="kv_cache_total_blocks")
    kv_usage: float = stat("Used KV blocks, 0..1", GAUGE, 0.0, metric="kv_cache_usage_perc")
    window_blocks_used: int = stat(
        "KV blocks of the sliding-window groups held by requests (engine/hybrid_blocks.py)",
        GAUGE,
        metric="kv_cache_window_blocks_used",
        sparse=True,
    )
    window_blocks_total: int = stat(
        "KV blocks of the sliding-window groups", GAUGE, metric="kv_cache_window_blocks",
        sparse=True,
    )  # fmt: skip
    prompt_tokens_computed: int = stat("Prompt tokens computed (not found in a cache)")
    prompt_tokens_cached: int = stat("Prompt tokens found in the prefix cache, any tier")
    generation_tokens: int = stat("Tokens generated")
    num_preemptions: int = stat("Requests preempted to free KV blocks")
    prompt_tokens_queried: int = stat("Prompt tokens of admitted requests that looked up the cache")
    cached_device_tokens: int = stat("Of prompt_tokens_cached, those in the device cache")
    cached_host_tokens: int = stat("Of prompt_tokens_cached, those loaded from the host tier")
    cached_disk_tokens: int = stat("Of prompt_tokens_cached, those loaded from the disk tier")
    cached_remote_tokens: int = stat("Of prompt_tokens_cached, those pulled from a peer")
    queued_tokens: int = stat("Prompt tokens admitted whose KV is not computed yet")
    spec_num_drafts: int = stat(
        "Speculative steps of a request (drafts verified)",
        COUNTER,
        metric="spec_decode_num_drafts",
        sparse=True,
    )
    spec_num_draft_tokens: int = stat(
        "Draft tokens verified", COUNTER, metric="spec_decode_num_draft_tokens", sparse=True
    )
    spec_num_accepted_tokens: int = stat(
        "Draft tokens accepted", COUNTER, metric="spec_decode_num_accepted_tokens", sparse=True
    )
    spec_accepted_per_pos: list[int] = stat(
        "Draft tokens accepted, by position in the draft (0: the first)",
        COUNTER,
        [],
        metric="spec_decode_num_accepted_tokens_per_pos",
        label="position",
    )

    @property
    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Tier -> prompt tokens served from it, the tiers that served any."""
        tokens = {tier: getattr(self, f"cached_{tier}_tokens") for tier in TIERS}
        return {tier: n for tier, n in tokens.items() if n}


def engine_stats(
    scheduler: Scheduler,
    blocks: BlockManager,
    prompt_tokens_computed: int,
    generation_tokens: int,
    spec: SpecCounters | None,
) -> EngineStats:
    """The statistics of an engine with this scheduler and block manager, its token counts,
    and its speculator's counters (None: speculation off)."""
    free, total = blocks.num_free_blocks, blocks.num_blocks
    tiers = scheduler.cached_tokens_by_tier
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=free,
        num_total_blocks=total,
        kv_usage=1.0 - free / total,
        window_blocks_used=sum(blocks.window_blocks_in_use()),
        window_blocks_total=sum(blocks.window_pool_blocks()),
        prompt_tokens_computed=prompt_tokens_computed,
        prompt_tokens_cached=scheduler.prompt_tokens_cached,
        generation_tokens=generation_tokens,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens_queried=scheduler.prompt_tokens_queried,
        cached_device_tokens=tiers.get("device", 0),
        cached_host_tokens=tiers.get("host", 0),
        cached_disk_tokens=tiers.get("disk", 0),
        cached_remote_tokens=tiers.get("remote", 0),
        queued_tokens=scheduler.queued_prompt_tokens(),
        spec_num_drafts=spec.num_drafts if spec else 0,
        spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
        spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
        spec_accepted_per_pos=list(spec.accepted_per_pos) if spec else [],
    )
