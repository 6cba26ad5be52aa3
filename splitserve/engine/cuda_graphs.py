"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

A decode-only step is padded up to the nearest captured batch size: padded rows read and write
a scratch KV block that the block manager never hands out, and their logits are dropped. The
block table has a fixed width (the context length in blocks), so every step of a bucket has
the same shapes. On CPU nothing is captured and the same padded inputs run eagerly, which is
how the padding logic is tested without a GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from splitserve.engine.layers.attention import AttentionMetadata
from splitserve.engine.scheduler import ScheduledBatch

if TYPE_CHECKING:
    from splitserve.engine.model_runner import ModelRunner
    from splitserve.engine.overlap import InflightStep


def bucket_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8, *range(16, max_batch + 1, 16)]
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_batch: int, capture: bool) -> None:
        self.runner = runner
        self.buckets = bucket_sizes(max_batch)
        self.max_batch = max_batch
        device, width = runner.device, runner.max_blocks_per_seq
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.tables = torch.zeros(max_batch, width, dtype=torch.long, device=device)
        self.lens = torch.ones(max_batch, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        if capture:
            self._capture_all()

    def fits(self, batch: ScheduledBatch) -> bool:
        return len(batch.requests) <= self.max_batch and all(
            n == 1 and req.num_computed_tokens + 1 == req.num_tokens
            for req, n in zip(batch.requests, batch.num_new_tokens)
        )

    @torch.inference_mode()
    def run(
        self, batch: ScheduledBatch, prev: InflightStep | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """prev: the step still in flight whose sampled tokens are this step's inputs
        wherever the host does not know them yet (overlapped scheduling)."""
        count = len(batch.requests)
        size = next(b for b in self.buckets if b >= count)
        self._fill(batch, size, prev)
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._forward(size)
        return logits[:count], list(range(count))

    def _fill(self, batch: ScheduledBatch, size: int, prev: InflightStep | None) -> None:
        """One host-to-device copy of the padded inputs, then device-side scatters into the
        static buffers; the input tokens that are still on the device come from prev."""
        bs, scratch = self.runner.block_size, self.runner.scratch_block
        width = self.tables.shape[1]
        ids, pos, slots, lens, tables = [], [], [], [], []
        rows, prev_rows = [], []
        prev_row = prev.row_of() if prev is not None else {}
        for row, req in enumerate(batch.requests):
            p = req.num_computed_tokens
            if req.num_pending:
                ids.append(0)
                rows.append(row)
                prev_rows.append(prev_row[id(req)])
            else:
                ids.append(req.all_token_ids[p])
            pos.append(p)
            slots.append(req.block_table[p // bs] * bs + p % bs)
            lens.append(p + 1)
            tables.append(req.block_table + [scratch] * (width - len(req.block_table)))
        padding = size - len(ids)
        ids += [0] * padding
        pos += [0] * padding
        slots += [scratch * bs] * padding
        lens += [1] * padding
        tables += [[scratch] * width] * padding
        flat = [*ids, *pos, *slots, *lens, *(i for t in tables for i in t), *rows, *prev_rows]
        staged = torch.tensor(flat, dtype=torch.long)
        device = self.input_ids.device
        if device.type == "cuda":
            # Pinned, so that the copy does not wait for the step in flight to finish.
            staged = staged.pin_memory()
        packed = staged.to(device, non_blocking=True)
        parts = packed.split([size, size, size, size, size * width, len(rows), len(rows)])
        self.input_ids[:size].copy_(parts[0])
        self.positions[:size].copy_(parts[1])
        self.slots[:size].copy_(parts[2])
        self.lens[:size].copy_(parts[3])
        self.tables[:size].copy_(parts[4].view(size, width))
        if rows:
            assert prev is not None
            self.input_ids[parts[5]] = prev.tokens[parts[6]]

    def _forward(self, size: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            num_decode_tokens=size,
            decode_block_tables=self.tables[:size],
            decode_context_lens=self.lens[:size],
            prefills=[],
        )
        model = self.runner.model
        hidden = model(self.input_ids[:size], self.positions[:size], meta)
        return model.compute_logits(hidden)

    @torch.inference_mode()
    def _capture_all(self) -> None:
        pool = None
        for size in reversed(self.buckets):
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize()
