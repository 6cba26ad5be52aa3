"""`splitserve bench eplb`: the EPLB simulator on an expert-load trace (``splitserve/eplb/``).

The trace is synthetic (``--trace zipf`` or ``drift``), a JSON file recorded from a run
(``--trace-file``), the files a served decode pool wrote (``--trace-dir``: workers with
``record_expert_load`` and ``expert_load_dir``), or recorded now (``--record MODEL``: the
engine generates from random prompts with ``record_expert_load`` on and the trace is written
to ``--trace-out``). For each group size in ``--ranks`` it reports the load imbalance (max /
mean over ranks) without and with EPLB and the modelled MoE time of a decode step. The cost
constants are parameters (``StepCosts``); ``--gemm-costs`` fits the expert GEMM's to a
measurement on a GPU (``benchmarks/moe/moe.py gemm``'s JSON), ``--a2a-costs`` the
all-to-all's (``benchmarks/moe/ep_check.py``'s ``a2a.json``, two GPUs or more).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from splitserve.bench.report import emit, header
from splitserve.eplb.simulate import SimConfig, StepCosts, simulate
from splitserve.eplb.traces import load_served, load_trace, save_trace, zipf_trace


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, nargs="+", default=[8, 64, 128])
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--redundant", type=int, default=32)
    parser.add_argument("--trace", choices=["zipf", "drift"], default="zipf")
    parser.add_argument("--trace-file", type=Path, default=None, help="a recorded trace (JSON)")
    parser.add_argument(
        "--trace-dir", type=Path, default=None, help="what served workers wrote (expert_load_dir)"
    )
    parser.add_argument("--record", default=None, help="record a trace from this MoE model")
    parser.add_argument("--trace-out", type=Path, default=None, help="where --record writes")
    parser.add_argument("--exponent", type=float, default=0.5, help="Zipf exponent")
    parser.add_argument("--drift", type=float, default=0.05, help="ranking shifts per step")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tokens-per-step", type=int, default=512, help="the group's batch")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--interval", type=int, default=50, help="eplb.interval_steps")
    parser.add_argument("--policy", choices=["global", "hierarchical"], default="global")
    parser.add_argument("--groups", type=int, default=8, help="expert groups (hierarchical)")
    parser.add_argument("--ranks-per-node", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    defaults = StepCosts()
    for field, value in vars(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=float, default=value)
    parser.add_argument(
        "--gemm-costs",
        type=Path,
        default=None,
        help="fit the expert GEMM's costs from this benchmarks/moe/moe.py gemm JSON",
    )
    parser.add_argument(
        "--a2a-costs",
        type=Path,
        default=None,
        help="fit the all-to-all's costs from this benchmarks/moe/ep_check.py a2a.json",
    )
    parser.add_argument("--out", type=Path, default=None)


def run(args: argparse.Namespace) -> int:
    given = [args.record, args.trace_file, args.trace_dir]
    if sum(source is not None for source in given) > 1:
        print(
            "splitserve bench eplb: give one of --record, --trace-file, --trace-dir",
            file=sys.stderr,
        )
        return 2
    trace, source = _trace(args)
    costs = StepCosts(**{f: getattr(args, f) for f in vars(StepCosts())})
    try:
        costs, measured = _measured_costs(args, costs)
    except (OSError, ValueError, KeyError) as exc:
        print(f"splitserve bench eplb: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    load = trace.sum(dim=0).double()
    results = []
    for ranks in args.ranks:
        start = time.perf_counter()
        cfg = SimConfig(
            ranks, args.redundant, args.interval, args.groups, args.ranks_per_node, args.policy
        )
        result = simulate(trace, cfg, costs)
        result["seconds"] = round(time.perf_counter() - start, 2)
        results.append(result)
        print(_line(ranks, result))
    report = header({**{k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}})
    report |= {
        "bench": "eplb",
        "trace": source
        | {
            "shape": list(trace.shape),
            "hot_over_mean": float((load.max(dim=1).values / load.mean(dim=1)).mean()),
        },
        "costs": {"measured": measured} | vars(costs),
        "results": results,
    }
    emit(report, args.out)
    return 0


def _measured_costs(args: argparse.Namespace, costs: StepCosts) -> tuple[StepCosts, dict[str, Any]]:
    """``costs`` with the expert GEMM's and the all-to-all's fitted to the measurements given
    (``--gemm-costs``, ``--a2a-costs``), and where each came from (None: not measured)."""
    measured: dict[str, Any] = {"expert_gemm": None, "all_to_all": None}
    if args.gemm_costs is not None:
        gemm = json.loads(args.gemm_costs.read_text())
        costs = costs.from_gemm_measurement(gemm)
        measured["expert_gemm"] = {
            "path": str(args.gemm_costs),
            "device": gemm.get("device"),
            "shape": gemm["shape"],
            "git_commit": gemm.get("git_commit"),
        }
    if args.a2a_costs is not None:
        a2a = json.loads(args.a2a_costs.read_text())
        costs = costs.from_a2a_measurement(a2a)
        measured["all_to_all"] = {
            "path": str(args.a2a_costs),
            "device": a2a.get("device"),
            "world_size": a2a.get("world_size"),
            "git_commit": a2a.get("git_commit"),
        }
    return costs, measured


def _trace(args: argparse.Namespace) -> tuple[torch.Tensor, dict[str, Any]]:
    if args.record is not None:
        trace = record(args.record, args.steps, args.seed)
        if args.trace_out is not None:
            save_trace(trace, args.trace_out)
        return trace, {"kind": "recorded", "model": args.record}
    if args.trace_file is not None:
        return load_trace(args.trace_file), {"kind": "file", "path": str(args.trace_file)}
    if args.trace_dir is not None:
        return load_served(args.trace_dir), {"kind": "served", "path": str(args.trace_dir)}
    drift = args.drift if args.trace == "drift" else 0.0
    trace = zipf_trace(
        args.experts, args.top_k, args.tokens_per_step, args.steps, args.layers,
        args.exponent, drift, args.seed,
    )  # fmt: skip
    return trace, {"kind": args.trace, "exponent": args.exponent, "drift": drift}


def record(model: str, max_tokens: int, seed: int) -> torch.Tensor:
    """Per-step expert load of ``model`` generating for 16 random prompts (16-64 tokens)."""
    from splitserve import LLM, SamplingParams

    llm = LLM(model=model, record_expert_load=True)
    generator = torch.Generator().manual_seed(seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [
        torch.randint(0, vocab, (int(n),), generator=generator).tolist()
        for n in torch.randint(16, 65, (16,), generator=generator)
    ]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    return llm.engine.expert_load.take()


def _line(ranks: int, result: dict[str, Any]) -> str:
    static, eplb = result["static"], result["eplb"]
    return (
        f"ranks {ranks:4d}  imbalance static {static['interval_imbalance']:.3f} "
        f"eplb {eplb['interval_imbalance']:.3f}  per step {static['step_imbalance']:.3f} / "
        f"{eplb['step_imbalance']:.3f}  MoE step us {static['moe_step_us']:.0f} / "
        f"{eplb['moe_step_us']:.0f}"
    )
