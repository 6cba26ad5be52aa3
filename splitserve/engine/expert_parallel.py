"""Expert parallelism over a group of engines: the lockstep loop.

Each rank of an expert-parallel group is a whole engine (``layers/expert_placement.py``
says where the experts live and how rows move between ranks). Every rank must run the same
number of forwards: ``lockstep_step`` runs an engine step and, when the engine had nothing
to compute, an idle pass through the MoE layers (no rows of its own, but its experts serve
the others'); ``any_unfinished`` tells all ranks whether any of them still has requests.
This loop drives engines, so it sits above the engine: nothing in the engine imports it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from splitserve.engine.layers.expert_placement import ExpertParallel
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.models.mixtral import MixtralForCausalLM
from splitserve.engine.request import RequestOutput


def any_unfinished(engine: LLMEngine, ep: ExpertParallel) -> bool:
    """Whether any rank of the group still has requests (a collective: every rank calls it)."""
    flag = torch.tensor([int(engine.has_unfinished_requests())], device=engine.runner.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ep.group)
    return bool(flag.item())


def lockstep_step(engine: LLMEngine) -> list[RequestOutput]:
    """One step of this rank, or an idle pass through the MoE layers if it computed nothing."""
    steps = engine.num_steps
    outputs = engine.step()
    model = engine.runner.model
    if engine.num_steps == steps and isinstance(model, MixtralForCausalLM):
        engine.expert_load.mark_step()  # a recorded trace counts the group's step here too
        model.idle_step()
    if engine.eplb is not None:
        engine.eplb.after_step()
    return outputs
