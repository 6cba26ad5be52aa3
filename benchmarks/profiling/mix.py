"""Where the offline engine's time goes on a serving mix: per-step wall time by step kind and a
cProfile of the host, for the same workload as benchmarks/served/offline_mix.py.

    python -m benchmarks.profiling.mix --prompts 256 --input-len 1024 --output-len 128 \
        --set cuda_graph_max_batch=256

Step kinds: ``decode`` (every row one token), ``mixed`` (prompt tokens beside decode rows),
``prefill`` (prompt tokens only). Prints a table and the top host functions; with --json, one
JSON line with the same numbers last.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import sys
import time
from collections import defaultdict
from typing import Any

from benchmarks.served.offline_mix import (
    add_mix_arguments,
    engine_args,
    engine_overrides,
    warm_mix,
)
from splitserve.engine.llm import LLM
from splitserve.engine.scheduler import ScheduledBatch


def main() -> int:
    args = _parse()
    settings = engine_args(args.device) | engine_overrides(args.engine)
    for item in args.overrides:
        key, value = item.split("=", 1)
        settings[key] = _value(value)
    llm = LLM(args.model, device=args.device, **settings)
    engine = llm.engine
    prompts, params = warm_mix(llm, args)

    kinds: list[tuple[str, int]] = []
    schedule = engine.scheduler.schedule

    def recorded() -> ScheduledBatch:
        batch = schedule()
        prompt = sum(n for n in batch.num_new_tokens if n > 1)
        rows = sum(1 for n in batch.num_new_tokens if n == 1)
        kind = "decode" if not prompt else ("mixed" if rows else "prefill")
        kinds.append((kind, len(batch.requests)))
        return batch

    engine.scheduler.schedule = recorded  # type: ignore[method-assign]
    for i, ids in enumerate(prompts):
        engine.add_request(f"p{i}", ids, params)
    times: dict[str, list[float]] = defaultdict(list)
    batches: dict[str, list[int]] = defaultdict(list)
    profiler = cProfile.Profile()
    tokens, start = 0, time.perf_counter()
    profiler.enable()
    while engine.has_unfinished_requests():
        before, t0 = len(kinds), time.perf_counter()
        outputs = engine.step()
        elapsed = time.perf_counter() - t0
        tokens += len(outputs)
        kind, size = kinds[-1] if len(kinds) > before else ("read", 0)
        times[kind].append(elapsed)
        batches[kind].append(size)
    profiler.disable()
    seconds = time.perf_counter() - start
    result = {
        "config": {**vars(args), "engine": settings},
        "seconds": seconds,
        "output_tokens": tokens,
        "output_throughput": tokens / seconds,
        "steps": {
            kind: {
                "count": len(values),
                "total_s": sum(values),
                "mean_ms": 1e3 * statistics.fmean(values),
                "mean_batch": statistics.fmean(batches[kind]),
            }
            for kind, values in times.items()
        },
        "phases_s": dict(engine.phases.seconds),
    }
    stream = io.StringIO()
    pstats.Stats(profiler, stream=stream).sort_stats("tottime").print_stats(args.top)
    print(stream.getvalue())
    print(f"{tokens / seconds:.0f} output tok/s over {seconds:.1f} s")
    for kind, row in result["steps"].items():
        print(
            f"  {kind:8} {row['count']:6} steps  {row['mean_ms']:8.2f} ms  "
            f"batch {row['mean_batch']:6.1f}  total {row['total_s']:6.2f} s"
        )
    if args.json:
        print(json.dumps(result))
    return 0


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_mix_arguments(parser)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--json", action="store_true")
    return parser.parse_args()


if __name__ == "__main__":
    sys.exit(main())
