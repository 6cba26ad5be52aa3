"""Dynamic verification replayed on recorded outputs: issue 49's table without a timer.

Greedy outputs are the same in every configuration, so the n-gram draft at each position of
each request, and how many of its tokens are right, are fixed by the plain output. This
records the plain outputs of `bench offline --speculative`'s workloads (SmolLM2, 64 tokens,
batch 8; batch 1 is each workload's first request), then replays plain, fixed k = 2, 4, 8
and the dynamic planner (engine/spec/dynamic.py, with the engine's pool) over them, a step
costing ``base + per_row x (rows - batch)`` ms (defaults: the AMD EPYC VM's one-thread
figures behind performance.md's n-gram record). What it measures is the planner's choices on
real drafts, free of the noise of a shared machine; it does not time the engine.

    .venv/bin/python -m benchmarks.cpu.spec_replay [--outputs FILE] [--out FILE]
"""

from __future__ import annotations

import argparse
import functools
import json
from pathlib import Path
from typing import Any

from splitserve.bench.report import emit, header
from splitserve.bench.spec_workloads import prompts
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec.dynamic import Acceptance, Evidence, plan_drafts
from splitserve.engine.spec.ngram import lookup

WORKLOADS = ("copy", "grounded", "free", "mixed")
OUTPUT_LEN = 64


def record(path: Path) -> dict[str, list[dict[str, list[int]]]]:
    """Each workload's 8 prompts and plain greedy outputs (read from ``path`` if there)."""
    if path.exists():
        recorded: dict[str, list[dict[str, list[int]]]] = json.loads(path.read_text())
        return recorded
    llm = LLM(model="smollm2-135m-instruct", device="cpu", max_model_len=2048, max_num_seqs=8)
    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0)
    recorded = {}
    for workload in WORKLOADS:
        batch = prompts(llm, workload, 8, 128)
        outputs = llm.generate(batch, params, use_tqdm=False)
        recorded[workload] = [
            {"prompt": p, "output": list(o.outputs[0].token_ids)} for p, o in zip(batch, outputs)
        ]
    path.write_text(json.dumps(recorded))
    return recorded


def replay(
    requests: list[dict[str, list[int]]], fixed: int | None, base: float, per_row: float
) -> dict[str, float]:
    """Decode tokens per second from every request's first token to the last, verifying
    ``fixed`` drafts of every lookup (None: the dynamic plan)."""
    batch = len(requests)
    pool = Evidence()
    rates = [Acceptance(pool) for _ in requests]
    made, seconds, verified, steps = [1] * batch, 0.0, 0, 0
    while True:
        live = [i for i in range(batch) if made[i] < len(requests[i]["output"])]
        if not live:
            break
        drafts: dict[int, list[int]] = {}
        for i in live:
            seen = requests[i]["prompt"] + requests[i]["output"][: made[i]]
            room = min(8 if fixed is None else fixed, OUTPUT_LEN - made[i] - 1)
            drafts[i] = lookup(seen, 2, 4, room) if room > 0 else []
        plain = base + per_row * (len(live) - batch)  # requests that finished leave rows
        if fixed is None:
            offers = [rates[i].offer(len(drafts[i])) for i in live]
            limits = plan_drafts(offers, functools.partial(_step_ms, plain, per_row))
        else:
            limits = [len(drafts[i]) for i in live]
        seconds += (plain + per_row * sum(limits)) / 1000
        steps, verified = steps + 1, verified + sum(limits)
        for i, limit in zip(live, limits):
            output, kept = requests[i]["output"], 0
            while kept < limit and made[i] + kept < len(output):
                if drafts[i][kept] != output[made[i] + kept]:
                    break
                kept += 1
            made[i] += min(1 + kept, len(output) - made[i])
            rates[i].record(limit, kept) if limit else rates[i].idle()
        pool.fade()
    decoded = sum(made) - batch
    return {"tokens_per_s": decoded / seconds, "verified_drafts_per_step": verified / steps}


def _step_ms(plain: float, per_row: float, drafts: int, longest: int) -> float:
    return plain + per_row * drafts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--outputs", default="benchmarks/results/spec-vm2c/smollm2-outputs.json")
    parser.add_argument("--out", default="benchmarks/results/spec-vm2c/cpu-spec-ngram-replay.json")
    parser.add_argument("--batch-1", default="10.3,3.5", help="ms of a batch-1 step, per row more")
    parser.add_argument("--batch-8", default="31.9,3.04", help="ms of a batch-8 step, per row")
    args = parser.parse_args()
    recorded = record(Path(args.outputs))
    costs = {1: [float(x) for x in args.batch_1.split(",")]}
    costs[8] = [float(x) for x in args.batch_8.split(",")]
    rows: list[dict[str, Any]] = []
    for workload in WORKLOADS:
        for batch, (base, per_row) in costs.items():
            requests = recorded[workload][:batch]
            row: dict[str, Any] = {"workload": workload, "batch": batch}
            for name, fixed in (("plain", 0), ("k2", 2), ("k4", 4), ("k8", 8), ("dynamic", None)):
                row[name] = replay(requests, fixed, base, per_row)
            best = max(("k2", "k4", "k8"), key=lambda n: row[n]["tokens_per_s"])
            dynamic = row["dynamic"]["tokens_per_s"]
            row["dynamic_over_best_fixed"] = dynamic / row[best]["tokens_per_s"]
            row["dynamic_over_plain"] = dynamic / row["plain"]["tokens_per_s"]
            rows.append(row)
            print(
                f"{workload:>8} batch {batch}: dynamic x{row['dynamic_over_best_fixed']:.3f} of "
                f"{best}, x{row['dynamic_over_plain']:.3f} of plain, "
                f"{row['dynamic']['verified_drafts_per_step']:.2f} drafts a step",
                flush=True,
            )
    emit(header(vars(args)) | {"replay": rows}, Path(args.out))


if __name__ == "__main__":
    main()
