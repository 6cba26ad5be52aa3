"""A worker's part in an expert-parallel group: forming the group, and stepping in lockstep.

A pool with ``expert_parallel: N`` runs each replica as N rank workers (services/launch/
deployment.py), each a whole engine with its own requests and KV; their MoE layers exchange
rows with all-to-all (engine/expert_parallel.py), so every rank must run every forward. Each
round every rank asks the group (one all-reduce) whether any rank has work; if one has, all
step: a rank without work of its own passes through the MoE layers idle. An idle group only
meets at that all-reduce, once per poll interval.

The group is formed through the deployment's rendezvous store under the replica's name and a
generation that the launcher counts: a group is always restarted whole (services/launch/
supervisor.py), every rank with the next generation, so the new ranks meet in a fresh group,
never in the one that broke. A collective that fails (a rank died: Gloo and NCCL see its
connections close) leaves the ranks out of step, so it stops the worker's loop
(``ThreadFailed``): its requests fail with a 503 and migrate to other groups.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch
import torch.distributed as dist

from splitserve.engine.expert_parallel import lockstep_step
from splitserve.engine.layers.expert_placement import ExpertParallel, GroupMember
from splitserve.kvstore.transfer import collective_group
from splitserve.services.workers.base import ThreadFailed
from splitserve.services.workers.spec import WorkerSpec

if TYPE_CHECKING:
    from splitserve.engine.llm_engine import LLMEngine
    from splitserve.engine.request import RequestOutput

T = TypeVar("T")
FORM_TIMEOUT_S = 120.0
"""How long a rank waits for the others to join (they load and start at the same time)."""


def join_group(spec: WorkerSpec, generation: int) -> GroupMember:
    """This worker's rank in start ``generation`` of its expert-parallel group, once every
    rank has joined."""
    group = spec.expert_group
    assert group is not None and spec.store is not None, "an expert group needs the store"
    process_group = collective_group(
        spec.store,
        f"ep/{group.name}/{generation}",
        group.rank,
        group.size,
        torch.device(spec.engine.device),
        "auto",  # by device: NCCL on CUDA (the KV transport may stage through Gloo)
        max(FORM_TIMEOUT_S, spec.transfer.timeout_s),
        key=spec.sealer.store_key(),
    )
    return GroupMember(group.rank, process_group)


class Lockstep:
    """Steps one rank's engine in lockstep with the rest of its group.

    Each round's all-reduce carries two flags: whether this rank has work, and whether it is
    stopping. A rank that stops (``leave``) takes part in one more round's all-reduce with the
    second flag set, then no more; the ranks that see it stop too (their loops end after that
    round), so a group stops together and no rank waits in a collective for one that left."""

    def __init__(self, engine: LLMEngine, name: str, stop: threading.Event) -> None:
        ep = engine.runner.model.ep
        assert isinstance(ep, ExpertParallel), "the engine was built without its group"
        self.engine = engine
        self.ep = ep
        self.name = name
        self._stop = stop
        self.busy = False
        """Whether any rank had work at the last round (the loop then polls without waiting)."""
        self.stopped = False
        """The group stopped (a rank left): no more collectives."""

    def any_busy(self) -> bool:
        """Whether any rank of the group has work (a collective: every rank asks each round).
        False once a rank of the group has left; this rank's loop then ends too."""
        flags = self._collective(lambda: self._all_reduce(stopping=False))
        if flags[1]:
            self.stopped = True
            self._stop.set()
        self.busy = bool(flags[0]) and not self.stopped
        return self.busy

    def step(self) -> list[RequestOutput]:
        """This rank's engine step, or its idle pass through the MoE layers."""
        return self._collective(lambda: lockstep_step(self.engine))

    def leave(self) -> None:
        """This rank stops: the round's all-reduce that tells the others (unless the group
        already stopped; a group that broke has nobody left to tell)."""
        if self.stopped:
            return
        self.stopped = True
        with contextlib.suppress(Exception):
            self._all_reduce(stopping=True)

    def _all_reduce(self, stopping: bool) -> list[int]:
        busy = int(self.engine.has_unfinished_requests())
        flags = torch.tensor([busy, int(stopping)], device=self.engine.runner.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ep.group)
        return [int(f) for f in flags.tolist()]

    def _collective(self, call: Callable[[], T]) -> T:
        try:
            return call()
        except Exception as exc:  # the ranks are out of step now: this worker stops
            self.stopped = True
            reason = f"expert-parallel group {self.name}: {type(exc).__name__}: {exc}"
            raise ThreadFailed(reason) from exc
