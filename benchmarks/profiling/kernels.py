"""Where a decode step's GPU time goes: the kernels of steady-state decode steps, by total time.

Runs eagerly (no CUDA graphs, no overlap), so that the profiler sees every kernel with its own
duration; a graph replays the same kernels. Prints one table per shape and writes JSON.

python -m benchmarks.profiling.kernels --shapes llama3-8b,smollm2-135m --context 1024
python -m benchmarks.profiling.kernels --shapes llama3-8b --batch 64 --context 4096 \
    --set kv_cache_dtype=fp8 --set quantization=fp8     # engine settings (EngineConfig's fields)
python -m benchmarks.profiling.kernels --shapes 'deepseek-v4-flash?layers=4' --prefill 8192
                                                         # one prefill of that many tokens instead
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def profile_shape(
    shape: str,
    batch: int,
    context: int,
    steps: int,
    memory: float = 0.3,
    settings: dict[str, Any] | None = None,
    prefill: int = 0,
    device: str = "cuda",
) -> dict[str, object]:
    """Kernels of ``steps`` steady decode steps of ``batch`` requests at ``context`` tokens,
    or (prefill > 0) of one request's prefill of that many tokens (after one warm-up)."""
    if prefill:
        batch, context, steps = 1, prefill, 1
    memory_setting: dict[str, Any] = {"gpu_memory_utilization": memory} if device == "cuda" else {}
    llm = LLM(
        model=f"shape:{shape}",
        device=device,
        attention_backend="triton" if device == "cuda" else "torch",
        max_model_len=context + 2 * steps + 64,
        max_num_batched_tokens=max(context * batch, 2048),
        **memory_setting,
        cuda_graph_max_batch=0,
        overlap_scheduling=False,
        **(settings or {}),
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 32, temperature=0, ignore_eos=True)
    if prefill:  # a warm-up prefill, then the profiled one (a prompt the cache has not seen)
        for i in range(2):
            prompt = [100 + (7 * i + j) % 1000 for j in range(context)]
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=1, temperature=0))
            if i:
                break
            while engine.has_unfinished_requests():
                engine.step()
    else:
        for i in range(batch):
            engine.add_request(str(i), [100 + (i + j) % 1000 for j in range(context)], params)
        for _ in range(8):
            engine.step()
    sync()
    start = time.perf_counter()
    cuda = device == "cuda"
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        if prefill:
            while engine.has_unfinished_requests():
                engine.step()
        else:
            for _ in range(steps):
                engine.step()
        sync()
    wall_ms = (time.perf_counter() - start) * 1000 / steps
    rows = []
    for event in prof.key_averages():
        total = event.device_time_total if cuda else event.self_cpu_time_total
        if total <= 0:
            continue
        rows.append(
            {
                "kernel": event.key[:90],
                "calls_per_step": event.count / steps,
                "us_per_step": total / steps,
                "us_per_call": total / max(event.count, 1),
            }
        )
    rows.sort(key=lambda r: -float(r["us_per_step"]))
    total_us = sum(float(r["us_per_step"]) for r in rows)
    calls = sum(float(r["calls_per_step"]) for r in rows)
    what = f"a {prefill}-token prefill" if prefill else f"batch {batch}, context {context}"
    print(
        f"\n{shape} {settings or ''}, {what}: {total_us:.1f} us of kernels per step, "
        f"{calls:.0f} kernels per step, {wall_ms:.1f} ms wall per step (profiled)"
    )
    print(f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
    for r in rows[:18]:
        print(
            f"{r['us_per_step']:9.1f} {r['calls_per_step']:6.0f} {r['us_per_call']:8.2f}  "
            f"{r['kernel']}"
        )
    del llm, engine
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "shape": shape,
        "settings": settings or {},
        "prefill": prefill,
        "batch": batch,
        "context": context,
        "wall_ms_per_step": wall_ms,
        "kernel_us_per_step": total_us,
        "kernels_per_step": calls,
        "kernels": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="llama3-8b,smollm2-135m")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an engine setting"
    )
    parser.add_argument("--prefill", type=int, default=0, help="profile a prefill of N tokens")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke run (torch ops, CPU time)")
    args = parser.parse_args()
    memory = args.gpu_memory_utilization
    settings = dict(_setting(item) for item in args.set)
    results = [
        profile_shape(
            s, args.batch, args.context, args.steps, memory, settings, args.prefill, args.device
        )
        for s in args.shapes.split(",")
    ]
    out = Path(os.environ.get("OUT", "benchmarks/results")) / "h200-kernel-profile.json"
    commit = os.environ.get("SPLITSERVE_GIT_COMMIT", "unknown")
    out.write_text(json.dumps({"git_commit": commit, "profiles": results}, indent=2) + "\n")
    return 0


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _setting(item: str) -> tuple[str, Any]:
    """KEY=VALUE with VALUE read as JSON where it is JSON (numbers, true), else as a string."""
    key, value = item.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


if __name__ == "__main__":
    sys.exit(main())
