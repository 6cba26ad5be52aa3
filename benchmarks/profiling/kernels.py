"""Where a decode step's GPU time goes: the kernels of steady-state decode steps, by total time.

Runs eagerly (no CUDA graphs, no overlap), so that the profiler sees every kernel with its own
duration; a graph replays the same kernels. Prints one table per shape and writes JSON.

python -m benchmarks.profiling.kernels --shapes llama3-8b,smollm2-135m --context 1024
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def profile_shape(
    shape: str, batch: int, context: int, steps: int, memory: float = 0.3
) -> dict[str, object]:
    llm = LLM(
        model=f"shape:{shape}",
        device="cuda",
        attention_backend="triton",
        max_model_len=context + 2 * steps + 64,
        max_num_batched_tokens=max(context * batch, 2048),
        gpu_memory_utilization=memory,
        cuda_graph_max_batch=0,
        overlap_scheduling=False,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * steps + 32, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(str(i), [100 + (i + j) % 1000 for j in range(context)], params)
    for _ in range(8):
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    rows = []
    for event in prof.key_averages():
        total = event.device_time_total if hasattr(event, "device_time_total") else 0.0
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
    print(
        f"\n{shape}, batch {batch}, context {context}: {total_us:.1f} us of kernels per step, "
        f"{calls:.0f} kernels per step"
    )
    print(f"{'us/step':>9} {'calls':>6} {'us/call':>8}  kernel")
    for r in rows[:18]:
        print(
            f"{r['us_per_step']:9.1f} {r['calls_per_step']:6.0f} {r['us_per_call']:8.2f}  "
            f"{r['kernel']}"
        )
    del llm, engine
    torch.cuda.empty_cache()
    return {
        "shape": shape,
        "batch": batch,
        "context": context,
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
    args = parser.parse_args()
    memory = args.gpu_memory_utilization
    results = [
        profile_shape(s, args.batch, args.context, args.steps, memory)
        for s in args.shapes.split(",")
    ]
    out = Path(os.environ.get("OUT", "benchmarks/results")) / "h200-kernel-profile.json"
    commit = os.environ.get("SPLITSERVE_GIT_COMMIT", "unknown")
    out.write_text(json.dumps({"git_commit": commit, "profiles": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
