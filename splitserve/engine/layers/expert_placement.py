"""Expert parallelism at the layer: where each expert of an MoE layer lives in a group of
engine processes (``torch.distributed``), and the all-to-all that moves rows between them.

Each rank is a whole engine with its own requests and KV (attention data-parallel); the
experts of every MoE layer are sharded over the ranks by a placement: rank r holds the
logical experts ``slots[r]`` (-1: an empty slot), a replicated expert's copies serving the
fractions ``shares`` of its tokens (``splitserve/eplb/``; without one, experts are split in
contiguous runs). In an MoE layer (``layers/moe.py``: ``distributed_experts``) each rank
routes its own tokens, sends every (token, expert) row to a rank holding a copy of that expert
(all-to-all), computes the rows it received with its local experts, and sends the results back
(all-to-all) to be combined. Copies of one expert hold the same weights, so which copy serves
a row does not change the result: a row's copy is drawn from its position in the step by a
low-discrepancy sequence, in proportion to the shares.

The group's ranks must run the same number of forwards: the loop that keeps them in step is
above the engine (``engine/expert_parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
import torch.distributed as dist

GOLDEN = 0.6180339887498949


@dataclass(frozen=True)
class ExpertParallel:
    rank: int
    size: int
    slots: torch.Tensor
    """[size, width] int64: the logical expert in each rank's slots, -1 if empty."""
    shares: torch.Tensor
    """[size, width] float64: the fraction of its expert's rows each slot serves."""
    group: Any = None
    """The torch.distributed process group (None: the default one)."""

    @classmethod
    def contiguous(cls, rank: int, size: int, num_experts: int) -> ExpertParallel:
        if num_experts % size:
            raise ValueError(f"{num_experts} experts do not divide over {size} ranks")
        slots = torch.arange(num_experts).view(size, -1)
        return cls(rank, size, slots, torch.ones(slots.shape, dtype=torch.float64))

    @property
    def width(self) -> int:
        return self.slots.shape[1]

    @property
    def local_slots(self) -> list[int]:
        """The logical expert of each of this rank's slots (-1: empty)."""
        return self.slots[self.rank].tolist()

    @cached_property
    def copies(self) -> tuple[torch.Tensor, torch.Tensor]:
        """([experts, C] flat slot of each copy, [experts, C] cumulative share up to it);
        experts with fewer copies repeat their last with cumulative share 1."""
        flat, shares = self.slots.flatten(), self.shares.flatten()
        num_experts = int(flat.max()) + 1
        where = [torch.nonzero(flat == e).flatten() for e in range(num_experts)]
        if any(len(w) == 0 for w in where):
            raise ValueError("every expert needs a slot in the placement")
        width = max(len(w) for w in where)
        table = torch.stack([torch.cat([w, w[-1:].repeat(width - len(w))]) for w in where])
        part = shares[table] * torch.tensor([[i < len(w) for i in range(width)] for w in where])
        cumulative = torch.cumsum(part, dim=1) / part.sum(dim=1, keepdim=True)
        return table, cumulative

    def destinations(self, experts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat logical experts [P] -> (rank, slot there) of the copy that serves each."""
        table, cumulative = self.copies
        position = (torch.arange(experts.numel(), dtype=torch.float64) * GOLDEN) % 1.0
        index = (cumulative[experts] <= position[:, None]).sum(dim=1).clamp(max=table.shape[1] - 1)
        slot = table[experts, index]
        return slot // self.width, slot % self.width

    def exchange(self, rows: torch.Tensor, send: list[int], recv: list[int]) -> torch.Tensor:
        """All-to-all of rows: ``send[r]`` rows to rank r, ``recv[r]`` rows from it."""
        out = rows.new_empty((sum(recv), *rows.shape[1:]))
        self.all_to_all(out, rows.contiguous(), recv, send)
        return out

    def counts(self, send: torch.Tensor) -> list[int]:
        """Each rank's row count for this rank, given this rank's ``send`` [size]."""
        recv = torch.empty_like(send)
        self.all_to_all(recv, send, [1] * self.size, [1] * self.size)
        return recv.tolist()

    def all_to_all(
        self, out: torch.Tensor, rows: torch.Tensor, recv: list[int], send: list[int]
    ) -> None:
        """``out`` gets ``recv[r]`` rows from rank r; ``rows`` sends ``send[r]`` to it."""
        if self.group is None:
            dist.all_to_all_single(out, rows, recv, send)
        else:  # a group formed by its members (GroupMember): the backend's own call
            self.group.alltoall_base(out, rows, recv, send, dist.AllToAllOptions()).wait()


@dataclass(frozen=True)
class GroupMember:
    """This process's place in an expert-parallel group that its worker formed through the
    deployment's rendezvous store (services/workers/); without one, an engine with
    ``expert_parallel_size > 1`` uses the default torch.distributed group."""

    rank: int
    group: Any
    """A torch.distributed process group (the backend's object)."""

    @property
    def size(self) -> int:
        return int(self.group.size())
