"""One rank of an expert-parallel group in a test: an engine process of a Gloo group that
generates its own prompts in lockstep with the other ranks (``engine/expert_parallel.py``)."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from splitserve import SamplingParams
from splitserve.engine.config import EngineConfig
from splitserve.engine.expert_parallel import any_unfinished, lockstep_step
from splitserve.engine.llm_engine import LLMEngine


def generate_in_group(
    rank: int,
    size: int,
    port: int,
    model: str,
    prompts: list[list[list[int]]],
    max_tokens: list[int],
    placements: list[dict[str, Any]],
    results: Any,
) -> None:
    """Rank ``rank`` greedily generates ``prompts[rank]`` (``max_tokens[rank]`` each) once
    per placement (EngineConfig keys) and puts (rank, {placement index: token ids},
    {placement index: (rebalances, final slots of each MoE layer)} for placements with
    ``eplb``) on ``results``."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        tokens: dict[int, list[list[int]]] = {}
        moved: dict[int, tuple[int, list[Any]]] = {}
        """Placements that rebalance: (rebalances, each MoE layer's slots at the end)."""
        params = SamplingParams(max_tokens=max_tokens[rank], temperature=0, ignore_eos=True)
        for index, placement in enumerate(placements):
            config = EngineConfig(
                model=model, max_model_len=256, block_size=8, expert_parallel_size=size, **placement
            )
            engine = LLMEngine(config)
            for i, prompt in enumerate(prompts[rank]):
                engine.add_request(str(i), prompt, params)
            done: dict[str, list[int]] = {}
            while any_unfinished(engine, engine.runner.model.ep):
                for output in lockstep_step(engine):
                    if output.finished:
                        done[output.request_id] = output.outputs[0].token_ids
            tokens[index] = [done[str(i)] for i in range(len(prompts[rank]))]
            if engine.eplb is not None:
                layers = engine.eplb.layers
                moved[index] = (
                    engine.eplb.rebalances,
                    [layer.ep.slots.tolist() for layer in layers],
                )
        results.put((rank, tokens, moved))
    finally:
        dist.destroy_process_group()


def move_in_group(
    rank: int,
    size: int,
    port: int,
    old: list[list[int]],
    new: list[list[int]],
    results: Any,
) -> None:
    """Rank ``rank`` holds a MoE layer whose slot weights are filled with their expert's id
    under placement ``old`` and moves them to ``new`` (``move_experts``); puts (rank, the
    expert id each new w13 slot and w2 slot holds) on ``results``."""
    import torch

    from splitserve.engine.expert_rebalance import move_experts
    from splitserve.engine.layers.expert_placement import ExpertParallel
    from splitserve.engine.layers.moe import SparseMoE
    from splitserve.engine.model_config import MoEConfig

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:

        def placement(slots: list[list[int]]) -> ExpertParallel:
            table = torch.tensor(slots)
            return ExpertParallel(rank, size, table, torch.ones(table.shape, dtype=torch.float64))

        moe = MoEConfig(num_experts=4, top_k=1, intermediate_size=3, renormalize=False)
        layer = SparseMoE(4, moe, placement(old))
        with torch.no_grad():
            for slot, expert in enumerate(old[rank]):
                layer.w13[slot] = expert
                layer.w2[slot] = expert
        move_experts(layer, placement(new))
        held = [
            [float(w.min()) if float(w.min()) == float(w.max()) else -1.0 for w in weight]
            for weight in (layer.w13, layer.w2)
        ]
        results.put((rank, held))
    finally:
        dist.destroy_process_group()


def one_engine_tokens(
    model: str, prompts: list[list[list[int]]], max_tokens: list[int]
) -> list[list[list[int]]]:
    """What one engine with every expert generates for each rank's prompts (the reference of
    ``generate_in_group``)."""
    from splitserve import LLM

    llm = LLM(model=model, max_model_len=256, block_size=8)
    return [
        [
            o.outputs[0].token_ids
            for o in llm.generate(
                batch,
                SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                use_tqdm=False,
            )
        ]
        for batch, n in zip(prompts, max_tokens)
    ]


def run_group(
    size: int,
    model: str,
    prompts: list[list[list[int]]],
    max_tokens: list[int],
    placements: list[dict[str, Any]],
) -> dict[int, tuple[dict[int, list[list[int]]], dict[int, tuple[int, list[Any]]]]]:
    """``generate_in_group`` on ``size`` processes of a Gloo group (tests/support/processes.py):
    rank -> (its tokens, its rebalances) as each put them; every process exited 0."""
    from tests.support import processes
    from tests.support.server_process import free_port

    context = processes.context()
    results = context.Queue()
    args = (size, free_port(), model, prompts, max_tokens, placements, results)
    workers = [context.Process(target=generate_in_group, args=(r, *args)) for r in range(size)]
    for worker in workers:
        worker.start()
    got = {
        rank: (tokens, moved) for rank, tokens, moved in (results.get(timeout=180) for _ in workers)
    }
    for worker in workers:
        worker.join(timeout=30)
        assert worker.exitcode == 0
    return got
