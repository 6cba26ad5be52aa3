"""Where a decode step's host time goes: cProfile over steady-state decode steps.

python -m benchmarks.profiling.step --shape smollm2-135m --device cuda --batch 1
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time

import torch

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="smollm2-135m")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--backend", default="triton")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()
    llm = LLM(
        model=f"shape:{args.shape}",
        device=args.device,
        attention_backend=args.backend,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=0.3,
    )
    engine = llm.engine
    params = SamplingParams(max_tokens=2 * args.steps + 100, temperature=0, ignore_eos=True)
    for i in range(args.batch):
        engine.add_request(str(i), list(range(100 + i, 164 + i)), params)
    for _ in range(20):
        engine.step()
    start = time.perf_counter()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        engine.step()
    profiler.disable()
    elapsed = time.perf_counter() - start
    print(f"{elapsed / args.steps * 1e3:.3f} ms/step (profiled), batch {args.batch}")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)
    start = time.perf_counter()
    for _ in range(args.steps // 2):
        engine.step()
    print(f"{(time.perf_counter() - start) / (args.steps // 2) * 1e3:.3f} ms/step (unprofiled)")
    graphs = engine.runner.graphs
    if graphs is not None and args.batch in graphs.graphs:
        # The GPU's own time per step: the decode graph replayed back to back, no host work.
        graph = graphs.graphs[args.batch]
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        begin.record()
        for _ in range(args.steps):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        print(f"{begin.elapsed_time(end) / args.steps:.3f} ms/step (graph replay alone)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
