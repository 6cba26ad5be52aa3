"""`splitserve bench offline --speculative METHOD`: plain decoding, fixed-k verification for
each k of ``--spec-ks`` and dynamic verification (engine/spec/dynamic.py, at most the largest
k) on the same prompts, in one run, written as JSON.

Workloads (bench/spec_workloads.py): copy, grounded, free, mixed, random. For each workload
and batch size every configuration runs ``--repeats`` times, the configurations in turn (a
rotated order each round, so that a noisy machine slows them alike); the medians are
reported, per second of wall time and per second of the process's CPU time (on a machine
shared with other work the steadier of the two), with each configuration's acceptance
(accepted / verified drafts, and tokens per verify step) and verified drafts per step. Every
configuration must give the plain greedy tokens (``outputs_equal``). Decode time runs from
the step that gave every request its first token to the end.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from splitserve.bench.report import emit, header
from splitserve.bench.spec_workloads import prompts
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def run_speculative(args: argparse.Namespace) -> int:
    model = f"shape:{args.shape}" if args.shape else args.model
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    ks = [int(k) for k in args.spec_ks.split(",")]
    spec: dict[str, Any] = {"method": args.speculative}
    if args.speculative == "draft_model":
        spec["model"] = args.draft_model
        if args.draft_seed is not None:
            spec["draft_seed"] = args.draft_seed
    if args.prompt_lookup_max is not None:
        spec["prompt_lookup_max"] = args.prompt_lookup_max
    common = dict(
        model=model,
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        max_model_len=2048,
        max_num_seqs=max(batch_sizes),
        gpu_memory_utilization=args.gpu_memory_utilization / (len(ks) + 2),
        overlap_scheduling=False if args.no_overlap else None,
    )
    configs = {"plain": None} | {
        f"k{k}": spec | {"num_speculative_tokens": k, "dynamic": False} for k in ks
    }
    configs["dynamic"] = spec | {"num_speculative_tokens": max(ks), "dynamic": True}
    engines = {name: LLM(**common, speculative_config=config) for name, config in configs.items()}
    result = header(vars(args) | {"model": model, "speculative_configs": configs})
    rows = []
    for workload in args.spec_workloads.split(","):
        for batch in batch_sizes:
            batch_prompts = prompts(engines["plain"], workload, batch, args.input_len)
            rows.append(_compare(engines, batch_prompts, args, workload))
            print(_line(rows[-1]), flush=True)
    result["speculative"] = rows
    out = Path(args.result_file or Path(args.result_dir) / f"cpu-spec-{args.speculative}.json")
    emit(result, out)
    return 0


def _compare(
    engines: dict[str, LLM], batch_prompts: list[list[int]], args: argparse.Namespace, name: str
) -> dict[str, Any]:
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=args.ignore_eos)
    names = list(engines)
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    outputs: dict[str, Any] = {}
    for repeat in range(args.repeats):
        for label in names[repeat % len(names) :] + names[: repeat % len(names)]:
            run, outputs[label] = _decode(engines[label], batch_prompts, params)
            runs[label].append(run)
    row: dict[str, Any] = {"workload": name, "batch": len(batch_prompts)}
    for label in names:
        row[label] = _summary(runs[label])
    fixed = [n for n in names if n.startswith("k")]
    for clock in ("tokens_per_s", "tokens_per_cpu_s"):
        suffix = "" if clock == "tokens_per_s" else "_cpu"
        plain = row["plain"][clock]
        best = max(fixed, key=lambda n: row[n][clock])
        for label in names:
            row[label]["speedup" + suffix] = row[label][clock] / plain
        row["best_fixed" + suffix] = best
        row["dynamic_over_best_fixed" + suffix] = row["dynamic"][clock] / row[best][clock]
        row["dynamic_over_plain" + suffix] = row["dynamic"][clock] / plain
    row["outputs_equal"] = all(outputs[n] == outputs["plain"] for n in names)
    return row


def _summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats; the counters over all of them."""
    total = {key: sum(run[key] for run in runs) for key in ("steps", "drafts", "verified")}
    accepted = sum(run["accepted"] for run in runs)
    return {
        "tokens_per_s": statistics.median(run["tokens"] / run["seconds"] for run in runs),
        "tokens_per_cpu_s": statistics.median(run["tokens"] / run["cpu_seconds"] for run in runs),
        "decode_s": statistics.median(run["seconds"] for run in runs),
        "decode_tokens": runs[0]["tokens"],
        "tokens_per_s_all": [round(run["tokens"] / run["seconds"], 2) for run in runs],
        "acceptance": accepted / total["verified"] if total["verified"] else None,
        "acceptance_length": 1 + accepted / total["drafts"] if total["drafts"] else None,
        "verified_drafts_per_step": total["verified"] / total["steps"],
        "verify_steps_per_request": total["drafts"] / len(runs),
    }


def _decode(llm: LLM, batch_prompts: list[list[int]], params: SamplingParams) -> tuple[Any, Any]:
    """The decode window's seconds, tokens, steps and speculation counters, and the outputs'
    token ids."""
    engine = llm.engine
    ids = [f"b{time.monotonic_ns()}-{i}" for i in range(len(batch_prompts))]
    for request_id, prompt in zip(ids, batch_prompts):
        engine.add_request(request_id, prompt, params)
    counts: dict[str, int] = {}
    first_at, first_cpu, seen, steps, done = 0.0, 0.0, 0, 0, {}
    before = _counters(llm)
    while engine.has_unfinished_requests():
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        steps += bool(first_at)
        if not first_at and len(counts) == len(ids):
            first_at, seen, before = time.perf_counter(), sum(counts.values()), _counters(llm)
            first_cpu = time.process_time()
    end, end_cpu = time.perf_counter(), time.process_time()
    after = _counters(llm)
    outputs = [done[i] for i in ids]
    run = {
        "seconds": end - first_at,
        "cpu_seconds": end_cpu - first_cpu,
        "tokens": sum(len(o) for o in outputs) - seen,
        "steps": max(steps, 1),
        **{key: after[key] - before[key] for key in after},
    }
    return run, outputs


def _counters(llm: LLM) -> dict[str, int]:
    spec = llm.engine.spec
    if spec is None:
        return {"drafts": 0, "verified": 0, "accepted": 0}
    counters = spec.counters
    return {
        "drafts": counters.num_drafts,
        "verified": counters.num_draft_tokens,
        "accepted": counters.num_accepted_tokens,
    }


def _line(row: dict[str, Any]) -> str:
    configs = [n for n in row if isinstance(row[n], dict)]
    parts = [f"{n} {row[n]['tokens_per_s']:.1f}" for n in configs]
    dynamic = row["dynamic"]
    return (
        f"{row['workload']:>8} batch {row['batch']:>3}: {', '.join(parts)} tok/s; dynamic "
        f"x{row['dynamic_over_plain']:.2f} of plain, x{row['dynamic_over_best_fixed']:.2f} of "
        f"{row['best_fixed']}; CPU time x{row['dynamic_over_plain_cpu']:.2f} of plain, "
        f"x{row['dynamic_over_best_fixed_cpu']:.2f} of {row['best_fixed_cpu']} (acceptance "
        f"{dynamic['acceptance']}, drafts/step {dynamic['verified_drafts_per_step']:.2f}); "
        f"equal {row['outputs_equal']}"
    )
