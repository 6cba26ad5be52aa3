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
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        count = len(batch.requests)
        size = next(b for b in self.buckets if b >= count)
        self._fill(batch, size)
        if size in self.graphs:
            self.graphs[size].replay()
            logits = self.logits[size]
        else:
            logits = self._forward(size)
        return logits[:count], list(range(count))

    def _fill(self, batch: ScheduledBatch, size: int) -> None:
        bs, scratch = self.runner.block_size, self.runner.scratch_block
        width = self.tables.shape[1]
        ids, pos, slots, lens, tables = [], [], [], [], []
        for req in batch.requests:
            p = req.num_computed_tokens
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
        for static, values in (
            (self.input_ids, ids),
            (self.positions, pos),
            (self.slots, slots),
            (self.lens, lens),
            (self.tables, tables),
        ):
            static[:size].copy_(torch.tensor(values, dtype=torch.long), non_blocking=True)

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
