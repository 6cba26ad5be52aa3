"""The host's bitmask fill of a constrained decode step, serial against parallel.

--batch matchers under decode.py's SCHEMA over its synthetic vocabulary (--vocab
tokens, Llama 3's by default) walk --steps decode steps: each step every matcher's row is
filled, then each accepts a seeded random token its row allows (what greedy decode of a
random-weight model picks). Every step is filled three ways on the same states, in turns: as
``apply_masks`` did before (a new bitmask, then one matcher after another), serially into a
kept buffer, and on each of --threads threads (``BatchMasks.fill``); the bitmasks must agree.
Prints ms per step (mean and median) and one JSON line last; --out writes the JSON to a file.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import xgrammar as xgr

from benchmarks.structured.decode import SCHEMA, synthetic_vocabulary
from splitserve.bench.report import emit, header
from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.engine.structured.grammar import GrammarCompiler
from splitserve.engine.structured.matcher import FILL_THREADS, BatchMasks

BITS = torch.arange(32, dtype=torch.int32)


def allowed(row: torch.Tensor, vocab: int) -> list[int]:
    """The token ids a bitmask row allows."""
    bits = ((row.unsqueeze(-1) >> BITS) & 1).flatten()[:vocab]
    return bits.nonzero().flatten().tolist()


def timed(fill: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    bitmask = fill()
    return 1e3 * (time.perf_counter() - start), bitmask


def walk(compiled: xgr.CompiledGrammar, args: argparse.Namespace) -> dict[str, list[float]]:
    """ms per step of each way of filling, over the same --steps steps of --batch matchers."""
    vocab, rows = args.vocab, list(range(args.batch))
    matchers = [xgr.GrammarMatcher(compiled) for _ in rows]
    kept = {threads: BatchMasks(threads) for threads in (1, *args.threads)}
    buffers = {threads: xgr.allocate_token_bitmask(args.batch, vocab) for threads in kept}

    def fresh() -> torch.Tensor:
        bitmask = xgr.allocate_token_bitmask(args.batch, vocab)
        for row, matcher in zip(rows, matchers):
            matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def into(threads: int) -> Callable[[], torch.Tensor]:
        def fill() -> torch.Tensor:
            kept[threads].fill(buffers[threads], matchers, rows)
            return buffers[threads]

        return fill

    ways: dict[str, Callable[[], torch.Tensor]] = {"fresh_serial": fresh, "kept_serial": into(1)}
    ways.update({f"kept_{threads}_threads": into(threads) for threads in args.threads})
    times: dict[str, list[float]] = {name: [] for name in ways}
    rng = random.Random(args.seed)
    names = list(ways)
    for step in range(args.warmup + args.steps):
        shift = step % len(names)  # each way goes first in turn
        masks = {}
        for name in names[shift:] + names[:shift]:
            ms, masks[name] = timed(ways[name])
            if step >= args.warmup:
                times[name].append(ms)
        reference = masks["fresh_serial"]
        assert all(torch.equal(mask, reference) for mask in masks.values()), f"step {step}"
        for row, matcher in zip(rows, matchers):
            choices = [t for t in allowed(reference[row], vocab) if t != vocab - 1]
            assert matcher.accept_token(rng.choice(choices))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--batch", type=int, default=32)
    cores = os.cpu_count() or 1
    parser.add_argument(
        "--threads", type=int, nargs="+", default=[2, *(t for t in (4, 8) if t <= cores)]
    )
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    compiler = GrammarCompiler.from_vocabulary(synthetic_vocabulary(args.vocab), [args.vocab - 1])
    times = walk(compiler.compile(StructuredOutputsParams(json=SCHEMA)), args)
    results = {
        name: {"mean_ms": statistics.fmean(ms), "median_ms": statistics.median(ms)}
        for name, ms in times.items()
    }
    serial = results["kept_serial"]["mean_ms"]
    for name, result in results.items():
        result["speedup_vs_kept_serial"] = serial / result["mean_ms"]
        print(
            f"{name:>16}: {result['mean_ms']:7.3f} ms/step mean, "
            f"{result['median_ms']:7.3f} median, x{result['speedup_vs_kept_serial']:.2f}",
            flush=True,
        )
    config = {**vars(args), "out": str(args.out), "schema": SCHEMA}
    report = {**header(config), "cpu_count": os.cpu_count(), "fill_threads": FILL_THREADS}
    report["results"] = results
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
