"""An engine's counters and gauges at one moment (what workers report and metrics export)."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.spec.speculator import SpecCounters


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    kv_usage: float
    prompt_tokens_computed: int
    prompt_tokens_cached: int
    generation_tokens: int
    num_preemptions: int
    prompt_tokens_queried: int = 0
    """Prompt tokens of admitted requests that looked up the prefix cache."""
    cached_tokens_by_tier: dict[str, int] | None = None
    """Tier (device, host, disk, remote: pulled from a peer) -> prompt tokens served from it."""
    queued_prompt_tokens: int = 0
    spec_num_drafts: int = 0
    """Speculative decoding (engine/spec/): request-steps that verified drafts, the draft
    tokens verified, those accepted, and accepted ones by draft position."""
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)


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
    spec = spec or SpecCounters()
    return EngineStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_free_blocks=free,
        num_total_blocks=total,
        kv_usage=1.0 - free / total,
        prompt_tokens_computed=prompt_tokens_computed,
        prompt_tokens_cached=scheduler.prompt_tokens_cached,
        generation_tokens=generation_tokens,
        num_preemptions=scheduler.num_preemptions,
        prompt_tokens_queried=scheduler.prompt_tokens_queried,
        cached_tokens_by_tier=dict(scheduler.cached_tokens_by_tier),
        queued_prompt_tokens=scheduler.queued_prompt_tokens(),
        spec_num_drafts=spec.num_drafts,
        spec_num_draft_tokens=spec.num_draft_tokens,
        spec_num_accepted_tokens=spec.num_accepted_tokens,
        spec_accepted_per_pos=list(spec.accepted_per_pos),
    )
