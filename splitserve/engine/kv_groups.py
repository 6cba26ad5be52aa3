"""The model runner's side of KV cache groups (``kv_cache_spec.KVCacheGroup``): how one byte
budget is split between the groups' pools, and each sliding-window group's attention
metadata for a step.

A window group's metadata gives every query only the blocks from the one holding its
window's first position (or the request's ``window_from``) on, its context counted from
there: the window is relative, so the mask is the same, and a query never reads a freed
(null) block nor gathers the context behind its window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from splitserve.engine.kv_cache_spec import KVCacheGroup
from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.engine.request import Request


@dataclass
class StepRows:
    """One request's rows in a step: positions [start, end) from flat row ``row`` on,
    each a decode row of its own (``decode``) or one prefill segment."""

    req: Request
    start: int
    end: int
    row: int
    decode: bool


def pool_sizes(
    groups: list[KVCacheGroup],
    budget: int,
    block_size: int,
    element: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    num_blocks: int | None = None,
    most: int | None = None,
) -> list[int]:
    """Blocks of each group's pool from one byte budget, or group 0's from ``num_blocks``
    (config.num_kv_blocks). A window group gets what its running requests can hold at once
    (each its window and two blocks, plus one step's new tokens), at most what it would need
    if it kept every token group 0 keeps; group 0 the rest, but beside window groups at most
    ``most`` blocks (every running request at the longest length: a group 0 of a few values
    a token, DeepSeek-V4's entries, would otherwise count millions of blocks). Where the
    budget caps a window group below what its requests can hold, group 0 gets no more blocks
    than it: a request that fits group 0 (admission checks that) then fits every window group
    on its own."""
    per_block = [g.spec.values_per_token() * block_size * element for g in groups]
    cap = num_blocks if num_blocks is not None else max(1, budget // sum(per_block))
    sizes = [0]
    spent = 0
    capped: list[int] = []
    for group, size in zip(groups[1:], per_block[1:]):
        assert group.window is not None
        tokens = max_num_seqs * (group.window + 2 * block_size) + max_num_batched_tokens
        wanted = -(-tokens // block_size)
        blocks = min(wanted, cap)
        if blocks < wanted:
            capped.append(blocks)
        sizes.append(blocks)
        spent += blocks * size
    if num_blocks is not None:
        sizes[0] = num_blocks
    else:
        limits = capped if most is None or len(groups) == 1 else [*capped, most]
        sizes[0] = min([max(1, (budget - spent) // per_block[0]), *limits])
    return sizes


def window_metadata(
    steps: list[StepRows],
    group: int,
    window: int,
    block_size: int,
    to_device: Callable[[list[int] | list[list[int]]], torch.Tensor],
    verify: bool,
) -> AttentionMetadata:
    """The metadata of sliding-window group ``group`` (1, 2, ...) for a step's rows."""
    bs = block_size
    slots: list[int] = []
    tables: list[list[int]] = []
    lens: list[int] = []
    prefills: list[PrefillSegment] = []
    for step in steps:
        table = step.req.window_tables[group - 1]
        slots.extend(table[p // bs] * bs + p % bs for p in range(step.start, step.end))
        if step.decode:
            for context in range(step.start + 1, step.end + 1):
                first = max(context - window, step.req.window_from) // bs
                tables.append(table[first : -(-context // bs)])
                lens.append(context - first * bs)
        else:
            first = max(step.start - window + 1, step.req.window_from) // bs
            blocks = to_device(table[first : -(-step.end // bs)])
            context = step.end - first * bs
            prefills.append(PrefillSegment(step.row, step.end - step.start, context, blocks))
    width = max((len(t) for t in tables), default=0)
    return AttentionMetadata(
        slot_mapping=to_device(slots),
        num_decode_tokens=len(lens),
        decode_block_tables=to_device([t + [0] * (width - len(t)) for t in tables]),
        decode_context_lens=to_device(lens),
        prefills=prefills,
        verify=verify,
    )
