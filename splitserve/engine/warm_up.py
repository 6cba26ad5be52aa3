"""Warm start: compile every kernel variant the configured limits can need before serving.

Triton compiles a kernel once per combination of its compile-time constants and of the
specialisation of its integer arguments (equal to 1, divisible by 16, neither). In eager steps
(a prompt chunk beside decode rows, or a decode batch over the graphs' largest bucket) these
follow the batch: the decode attention's split count (a power of two, from the batch size and
the block table's width), its tile (below or above one program per SM), the block table's
width (a power of two of blocks in eager steps, see ``decode_width``), the prefill table's
width and the row counts. Left to the first requests, each new combination stalls a step for
the compile (seen on an H200: TTFT p99 2.7 s and TPOT over 60 ms in the first minute).

``warm_up`` runs the model once over every such combination, on inputs whose KV reads and
writes go to the scratch block only, so that no request's KV is touched. The CUDA graphs are
captured afterwards (engine/cuda_graphs.py), so their buckets are covered by their capture.
"""

from __future__ import annotations

import time

import torch

from splitserve.engine.layers.attention import AttentionMetadata, PrefillSegment
from splitserve.engine.paged_model import PagedModel
from splitserve.engine.sampler import greedy_tokens

MIN_EAGER_WIDTH = 16
"""Blocks of the narrowest eager decode block table (a multiple of 16: one specialisation)."""


def decode_width(blocks: int, max_blocks: int) -> int:
    """The eager decode block table's width for a longest table of ``blocks``: the next power
    of two (at least MIN_EAGER_WIDTH), at most max_blocks, so that few widths occur."""
    width = MIN_EAGER_WIDTH
    while width < blocks:
        width *= 2
    return max(min(width, max_blocks), blocks)


def batch_sizes(max_num_seqs: int) -> list[int]:
    """Decode batch sizes whose variants cover every batch up to max_num_seqs: powers of two
    (the split counts and tiles change at powers of two of the batch), one over each power of
    two from 16 on (not divisible by 16), 1, 3, and the limit itself."""
    sizes = {1, min(3, max_num_seqs), max_num_seqs}
    power = 2
    while power <= max_num_seqs:
        sizes.add(power)
        if power >= 16 and power + 1 <= max_num_seqs:
            sizes.add(power + 1)
        power *= 2
    return sorted(sizes)


def decode_widths(max_blocks: int) -> list[int]:
    widths, width = [], MIN_EAGER_WIDTH
    while width < max_blocks:
        widths.append(width)
        width *= 2
    return [*widths, max_blocks]


@torch.inference_mode()
def warm_up(runner: PagedModel, max_num_seqs: int, max_prefill_tokens: int) -> float:
    """Run every eager step shape the limits allow once; returns the seconds it took."""
    start = time.perf_counter()
    max_blocks = runner.max_blocks_per_seq
    for batch in batch_sizes(max_num_seqs):
        for width in decode_widths(max_blocks):
            _forward(runner, batch, width, [])
            _forward(runner, batch, width, [16])  # a mixed step: decode rows beside a prompt
    bs = runner.block_size
    longest = min(max_prefill_tokens, max_blocks * bs)
    for length in sorted({16, 17, longest}):
        for cached_blocks in (0, 17, 32):
            if length + cached_blocks * bs <= max_blocks * bs:
                _forward(runner, 0, 0, [length], cached_blocks)
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    return time.perf_counter() - start


def _forward(
    runner: PagedModel,
    decode_rows: int,
    width: int,
    prompt_lens: list[int],
    cached_blocks: int = 0,
) -> None:
    """One eager step: decode rows with full tables of ``width`` blocks, then prompt chunks
    after ``cached_blocks`` blocks of context; every slot and block is the scratch block (in
    each sliding-window group, that group's null block)."""
    tokens = decode_rows + sum(prompt_lens)
    shape = decode_rows, width, prompt_lens, cached_blocks
    meta = _scratch_metadata(runner, runner.scratch_block, *shape)
    meta.windows = [_scratch_metadata(runner, null, *shape) for null in runner.window_blocks]
    input_ids = torch.zeros(tokens, dtype=torch.long, device=runner.device)
    positions = torch.zeros(tokens, dtype=torch.long, device=runner.device)
    hidden = runner.model(input_ids, positions, meta)
    rows = list(range(decode_rows)) + [p.start + p.length - 1 for p in meta.prefills]
    logits = runner.model.compute_logits(hidden[torch.tensor(rows, device=runner.device)])
    greedy_tokens(logits)


def _scratch_metadata(
    runner: PagedModel,
    scratch: int,
    decode_rows: int,
    width: int,
    prompt_lens: list[int],
    cached_blocks: int,
) -> AttentionMetadata:
    device, bs = runner.device, runner.block_size
    tokens = decode_rows + sum(prompt_lens)
    slots = torch.full((tokens,), scratch * bs, dtype=torch.long, device=device)
    prefills, row = [], decode_rows
    for length in prompt_lens:
        context = cached_blocks * bs + length
        table = torch.full((-(-context // bs),), scratch, dtype=torch.long, device=device)
        prefills.append(PrefillSegment(row, length, context, table))
        row += length
    return AttentionMetadata(
        slot_mapping=slots,
        num_decode_tokens=decode_rows,
        decode_block_tables=torch.full(
            (decode_rows, width), scratch, dtype=torch.long, device=device
        ),
        decode_context_lens=torch.full((decode_rows,), width * bs, dtype=torch.long, device=device),
        prefills=prefills,
    )


MOST_TIMED_ROWS = 256
"""A step-time curve is timed up to this many rows (past it a step is compute-bound: the
curve goes on along its last slope), so that a large max_num_seqs starts in seconds."""


def rows_to_time(most_rows: int) -> list[int]:
    """Row counts a step-time curve is timed at: every count up to 24, then about eight a
    doubling, and the most itself (at most MOST_TIMED_ROWS)."""
    most_rows = min(most_rows, MOST_TIMED_ROWS)
    rows, step = list(range(1, min(most_rows, 24) + 1)), 8
    while rows[-1] + step < most_rows:
        rows.append(rows[-1] + step)
        step = max(8, rows[-1] // 8)
    return sorted({*rows, most_rows})


@torch.inference_mode()
def time_decode_rows(runner: PagedModel, most_rows: int, repeats: int = 2) -> dict[int, float]:
    """Seconds of a decode step of each of ``rows_to_time(most_rows)`` rows, on scratch-block
    inputs as ``warm_up`` runs them: the step-time curve that dynamic speculation plans with
    (engine/spec/dynamic.py). Each count is run once untimed, then timed once in each of
    ``repeats`` passes over all the counts, every other pass in reverse order, and the fastest
    is kept: other work on the machine only slows a step, and a burst of it stalls the runs
    timed within it, which passes apart spread over different counts."""
    width = decode_width(MIN_EAGER_WIDTH, runner.max_blocks_per_seq)
    counts = rows_to_time(most_rows)
    for rows in counts:
        _forward(runner, rows, width, [])
    seconds: dict[int, float] = {}
    for repeat in range(repeats):
        for rows in counts if repeat % 2 == 0 else counts[::-1]:
            start = time.perf_counter()
            _forward(runner, rows, width, [])
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            seconds[rows] = min(seconds.get(rows, float("inf")), time.perf_counter() - start)
    return seconds
