"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step is padded up to the nearest captured batch size: padded rows read and write
a scratch KV block that the block manager never hands out, and their logits are dropped. The
block table has a fixed width (the context length in blocks), so every step of a bucket has
the same shapes. On CPU nothing is captured and the same padded inputs run eagerly, which is
how the padding logic is tested without a GPU.

Each bucket's inputs (token ids, positions, slots, context lengths, block tables, and for each
sliding-window KV cache group its rows' slots, lengths and tables as ``kv_groups.py:
window_metadata`` gives them, each table as wide as the window's blocks can be) are views of
one flat buffer, filled by one host-to-device copy per step. Each graph also takes the
argmax of its logits (``run_greedy``): an overlapped greedy step then launches nothing but the
copy and the graph.

With speculative decoding a second set of graphs runs verify steps: a request's last token
and its drafts are decode rows of their own (engine/layers/attention.py), up to
``verify_rows`` rows in all, captured with the K/V write apart from attention (the rows read
each other's K/V).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.engine.kv_cache_spec import KVCacheGroup
from splitserve.engine.layers.attention import AttentionMetadata
from splitserve.engine.overlap import InflightStep
from splitserve.engine.paged_model import PagedModel
from splitserve.engine.request import Request, decodes
from splitserve.engine.sampler import greedy_tokens
from splitserve.engine.scheduler import ScheduledBatch


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_batch + 1, 16)]
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


@dataclass(frozen=True)
class WindowGroup:
    """A sliding-window KV cache group as the graphs' inputs hold it: its window, the widest
    table a decode row's window takes (``width`` blocks) and its scratch (null) block."""

    window: int
    width: int
    scratch: int

    @classmethod
    def of(cls, window: int, block_size: int, scratch: int) -> WindowGroup:
        return cls(window, -(-window // block_size) + 1, scratch)


def window_groups(
    groups: list[KVCacheGroup], block_size: int, pools: list[int]
) -> list[WindowGroup]:
    """The sliding-window groups (1, 2, ...) of a runner's KV cache groups, each pool's size
    being its null block."""
    return [
        WindowGroup.of(group.window or 0, block_size, blocks)
        for group, blocks in zip(groups[1:], pools)
    ]


class WindowInputs:
    """A window group's static inputs: slots, context lengths [size], tables [size, width]."""

    def __init__(self, flat: torch.Tensor, size: int, width: int) -> None:
        self.slots, self.lens, tables = flat.split([size, size, size * width])
        self.tables = tables.view(size, width)
        self.lens.fill_(1)


Staged = tuple[np.ndarray, np.ndarray, np.ndarray]
"""A window group's part of the staging buffer: slots, lengths, tables."""


class BucketInputs:
    """One bucket's static inputs as views of one flat int64 buffer, in the order the host
    packs them: ids, positions, slots, context lengths [size] each, tables [size, width],
    then each window group's (``WindowInputs``)."""

    def __init__(
        self, size: int, width: int, device: torch.device, windows: list[int] | None = None
    ) -> None:
        lengths = [size * (4 + width), *(size * (2 + w) for w in windows or [])]
        self.flat = torch.zeros(sum(lengths), dtype=torch.long, device=device)
        own, *parts = self.flat.split(lengths)
        ids, pos, slots, lens, tables = own.split([size, size, size, size, size * width])
        self.input_ids, self.positions, self.slots, self.lens = ids, pos, slots, lens
        self.tables = tables.view(size, width)
        self.lens.fill_(1)
        self.windows = [WindowInputs(p, size, w) for p, w in zip(parts, windows or [])]


class DecodeGraphs:
    def __init__(
        self,
        runner: PagedModel,
        max_batch: int,
        capture: bool,
        verify_rows: int = 0,
        windows: list[WindowGroup] | None = None,
    ) -> None:
        """windows: the runner's sliding-window KV cache groups (1, 2, ...), if any."""
        self.runner = runner
        self.windows = windows or []
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        self.verify_buckets = bucket_sizes(verify_rows) if verify_rows else []
        self.verify_rows = verify_rows
        device, self.width = runner.device, runner.max_blocks_per_seq
        sizes = sorted({*self.buckets, *self.verify_buckets})
        widths = [w.width for w in self.windows]
        self.inputs = {size: BucketInputs(size, self.width, device, widths) for size in sizes}
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        """(bucket, verify) -> its graph."""
        self.logits: dict[tuple[int, bool], torch.Tensor] = {}
        self.greedy: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, batch: ScheduledBatch) -> bool:
        """A decode step (every request computes its last token) or, with verify graphs, a
        verify step (its last token and its drafts) of a size that was captured."""
        if not all(decodes(req, n) for req, n in zip(batch.requests, batch.num_new_tokens)):
            return False
        rows = sum(batch.num_new_tokens)
        if rows > len(batch.requests):
            return rows <= self.verify_rows
        return rows <= self.max_batch

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, prev: InflightStep | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """prev: the step still in flight whose sampled tokens are this step's inputs
        wherever the host does not know them yet (overlapped scheduling). A verify step
        returns 1 + len(drafts) rows of logits per request, in position order."""
        rows = sum(batch.num_new_tokens)
        return self._step(batch, prev)[1][:rows], list(range(len(batch.requests)))

    @torch.inference_mode()
    def run_greedy(self, batch: ScheduledBatch, prev: InflightStep | None) -> torch.Tensor:
        """run(), then each request's argmax token on the device (taken inside the graph)."""
        count = len(batch.requests)
        size, logits = self._step(batch, prev)
        if (size, False) in self.graphs:
            return self.greedy[size][:count]
        return greedy_tokens(logits[:count])

    def _step(self, batch: ScheduledBatch, prev: InflightStep | None) -> tuple[int, torch.Tensor]:
        """Fills the smallest bucket that holds the batch and runs it: (bucket, its logits)."""
        rows = sum(batch.num_new_tokens)
        verify = rows > len(batch.requests)
        size = next(b for b in (self.verify_buckets if verify else self.buckets) if b >= rows)
        self._fill(batch, size, prev)
        graph = self.graphs.get((size, verify))
        if graph is not None:
            graph.replay()
            return size, self.logits[size, verify]
        return size, self._forward(size, verify)

    def _fill(self, batch: ScheduledBatch, size: int, prev: InflightStep | None) -> None:
        """One host-to-device copy of the padded inputs into the bucket's buffer; the input
        tokens that are still on the device come from prev.

        The staging buffer is filled through numpy: each row's block table is one slice
        assignment and the padding one fill, where building a bucket x width list of Python
        ints per step took most of a served decode loop at large buckets (py-spy, H200)."""
        bs, scratch = self.runner.block_size, self.runner.scratch_block
        inputs = self.inputs[size]
        on_cuda = inputs.flat.device.type == "cuda"
        # Pinned, so that the copy does not wait for the step in flight to finish; the caching
        # host allocator keeps the block until that copy is done.
        staged = torch.empty(inputs.flat.numel(), dtype=torch.long, pin_memory=on_cuda)
        host = staged.numpy()
        ids, pos, slots, lens = (host[i * size : (i + 1) * size] for i in range(4))
        tables = host[4 * size : size * (4 + self.width)].reshape(size, self.width)
        tables.fill(scratch)
        windows = self._staged_windows(host[size * (4 + self.width) :], size)
        rows, prev_rows = [], []
        prev_row = prev.row_of() if prev is not None else {}
        row = 0
        for req in batch.requests:
            p, table = req.num_computed_tokens, req.block_table
            if req.num_pending:
                ids[row] = 0
                rows.append(row)
                prev_rows.append(prev_row[id(req)])
            else:
                ids[row] = req.all_token_ids[p]
            for draft in [None, *req.draft_token_ids]:  # a verify step: a row per draft
                if draft is not None:
                    ids[row] = draft
                pos[row] = p
                slots[row] = table[p // bs] * bs + p % bs
                lens[row] = p + 1
                tables[row, : len(table)] = table
                if windows:
                    self._stage_window_row(windows, req, row, p)
                row, p = row + 1, p + 1
        ids[row:] = 0
        pos[row:] = 0
        slots[row:] = scratch * bs
        lens[row:] = 1
        for group, (w_slots, w_lens, _) in zip(self.windows, windows):
            w_slots[row:] = group.scratch * bs
            w_lens[row:] = 1
        inputs.flat.copy_(staged, non_blocking=True)
        if not rows:
            return
        assert prev is not None
        if rows == prev_rows == list(range(len(rows))):
            # Steady state: the same requests in the same order as the step in flight.
            inputs.input_ids[: len(rows)].copy_(prev.tokens[: len(rows)])
        else:
            index = torch.tensor([*rows, *prev_rows]).to(inputs.flat.device, non_blocking=True)
            dst, src = index.split(len(rows))
            inputs.input_ids[dst] = prev.tokens[src]

    def _staged_windows(self, host: np.ndarray, size: int) -> list[Staged]:
        """Views of the staging buffer's window-group parts: (slots, lens, tables) each, the
        tables filled with the group's scratch block."""
        staged = []
        for group in self.windows:
            part, host = host[: size * (2 + group.width)], host[size * (2 + group.width) :]
            tables = part[2 * size :].reshape(size, group.width)
            tables.fill(group.scratch)
            staged.append((part[:size], part[size : 2 * size], tables))
        return staged

    def _stage_window_row(self, windows: list[Staged], req: Request, row: int, p: int) -> None:
        """Row ``row`` (req's position p) of each window group, as ``window_metadata``."""
        bs = self.runner.block_size
        for group, (slots, lens, tables), table in zip(self.windows, windows, req.window_tables):
            first = max(p + 1 - group.window, req.window_from) // bs
            blocks = table[first : -(-(p + 1) // bs)]
            slots[row] = table[p // bs] * bs + p % bs
            lens[row] = p + 1 - first * bs
            tables[row, : len(blocks)] = blocks

    def _forward(self, size: int, verify: bool = False) -> torch.Tensor:
        inputs = self.inputs[size]
        meta = AttentionMetadata(
            slot_mapping=inputs.slots,
            num_decode_tokens=size,
            decode_block_tables=inputs.tables,
            decode_context_lens=inputs.lens,
            prefills=[],
            verify=verify,
            windows=[
                AttentionMetadata(w.slots, size, w.tables, w.lens, [], verify)
                for w in inputs.windows
            ],
        )
        model = self.runner.model
        hidden = model(inputs.input_ids, inputs.positions, meta)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        shapes = [(size, False) for size in self.buckets]
        shapes += [(size, True) for size in self.verify_buckets]
        for size, verify in sorted(shapes, reverse=True):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(size, verify)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.logits[size, verify] = self._forward(size, verify)
                if not verify:
                    self.greedy[size] = greedy_tokens(logits)
            pool = graph.pool()
            self.graphs[size, verify] = graph
        torch.cuda.synchronize()
