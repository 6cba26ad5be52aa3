"""The served comparison: what a user of the service sees, deployment against deployment.

For each deployment this starts `splitserve serve` (a real server, as a user runs it), times how
long it takes to say ready (warm start), checks that the first request after ready is as fast as
the hundredth, then sweeps Poisson rates on each mix with `splitserve bench serve` and reads the
workers' per-phase loop timing from /metrics around every rate. Beside it, in the same run, the
offline engine does the same mix with every prompt submitted at once (the ceiling the service is
held to). Goodput is the highest rate at which at least 90% of requests meet TTFT <= 500 ms and
TPOT <= 30 ms.

    python -m benchmarks.served.comparison                     # every GPU it finds
    python -m benchmarks.served.comparison --quick --device cpu --model smollm2-135m-instruct

One GPU: colocated. Two: 1P1D against colocated with 2 replicas (same two GPUs). JSON per
deployment and mix, and one summary, go to --out (default $OUT or benchmarks/results).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.served.process import REPO, Server, describe, phase_table, phase_totals, set_args
from splitserve.bench.report import header

MIXES = {"1024/128": (1024, 128), "4096/256": (4096, 256), "256/1024": (256, 1024)}
RATES = {"1024/128": [4, 8, 16, 32], "4096/256": [1, 2, 4, 8], "256/1024": [2, 4, 8, 16]}
SLO_TTFT_MS, SLO_TPOT_MS, SLO_SHARE = 500.0, 30.0, 0.9
PROBE_REQUESTS = 100


def main() -> int:
    args = _parse()
    out = Path(args.out or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    mixes = {name: MIXES[name] for name in args.mixes.split(",")}
    if args.quick:  # the same code paths at a size a CPU runs in a minute
        mixes = {name: (i // 16, o // 16) for name, (i, o) in mixes.items()}
    summary: dict[str, Any] = header({**vars(args), "mixes": list(mixes)})
    summary["offline"] = {m: _offline(args, *mixes[m]) for m in mixes}
    summary["deployments"] = {}
    for name, overrides in _deployments(args):
        summary["deployments"][name] = _deployment(args, out, name, overrides, mixes)
        (out / "served-comparison.json").write_text(json.dumps(summary, indent=2) + "\n")
    _print(summary)
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="shape:llama3-8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--gpus", type=int, default=None, help="default: every visible GPU")
    parser.add_argument("--mixes", default=",".join(MIXES))
    parser.add_argument("--rates", default=None, help="one sweep for every mix, e.g. 4,8,16")
    parser.add_argument("--num-prompts", type=int, default=200, help="per rate")
    parser.add_argument(
        "--seconds-per-rate",
        type=float,
        default=None,
        help="cap a finite rate's prompts at rate x this (at least 20): low rates of long mixes",
    )
    parser.add_argument("--offline-prompts", type=int, default=None, help="default: --num-prompts")
    parser.add_argument("--quick", action="store_true", help="tiny run (CPU smoke test)")
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.gpus is None:
        args.gpus = _gpu_count() if args.device == "cuda" else 1
    return args


def _gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def _deployments(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    """(name, --config and --set arguments) of each deployment this machine can hold."""
    common = [f"model={args.model}", *args.overrides]
    if args.device == "cpu":
        return [("colocated-1", ["--config", "configs/colocated.yaml", *set_args(common)])]
    runs = [("colocated-1", ["--config", "configs/gpu-colocated.yaml", *set_args(common)])]
    if args.gpus >= 2:
        runs.append(("1p1d", ["--config", "configs/gpu-1p1d.yaml", *set_args(common)]))
        two = [*common, "pools.colocated.replicas=2"]
        runs.append(("colocated-2", ["--config", "configs/gpu-colocated.yaml", *set_args(two)]))
    return runs


def _deployment(
    args: argparse.Namespace,
    out: Path,
    name: str,
    serve_args: list[str],
    mixes: dict[str, tuple[int, int]],
) -> dict[str, Any]:
    print(f"== {name}: splitserve serve {' '.join(serve_args)}", flush=True)
    with Server(serve_args) as server:
        result: dict[str, Any] = {"ready_s": server.ready_s, "serve_args": serve_args}
        result["first_vs_hundredth"] = _probe(args, server)
        result["mixes"] = {}
        for m, (mix, (input_len, output_len)) in enumerate(mixes.items()):
            runs = []
            for r, rate in enumerate(_rates(args, mix)):
                # Each run its own prompts (a seed per mix and rate): with the same prompts every
                # rate after the first would read the KV of the one before from the prefix cache.
                seed = 1000 * (m + 1) + r
                runs.append(
                    _rate_run(args, out, server, name, mix, input_len, output_len, rate, seed)
                )
            result["mixes"][mix] = {"runs": runs, "goodput_rate": _goodput(runs)}
        result["worker_log_tail"] = server.lines[-5:]
    return result


def _rates(args: argparse.Namespace, mix: str) -> list[float]:
    if args.quick:
        return [2.0]
    rates = [float(r) for r in args.rates.split(",")] if args.rates else RATES[mix]
    return [*rates, float("inf")]


def _probe(args: argparse.Namespace, server: Server) -> dict[str, Any]:
    """Latency of the 1st and the 100th request after ready (distinct prompts, one at a time)."""
    count = 5 if args.quick else PROBE_REQUESTS
    seconds = [server.timed_completion(index, 256, 16) for index in range(count)]
    return {"first_s": seconds[0], "last_s": seconds[-1], "count": count, "all_s": seconds}


def _rate_run(
    args: argparse.Namespace,
    out: Path,
    server: Server,
    name: str,
    mix: str,
    input_len: int,
    output_len: int,
    rate: float,
    seed: int,
) -> dict[str, Any]:
    tag = f"{name}-{mix.replace('/', 'x')}-{'sat' if rate == float('inf') else f'{rate:g}'}"
    path = out / f"serve-{tag}.json"
    prompts = 8 if args.quick else _prompts(args, rate)
    before = phase_totals(server.url)
    command = [
        sys.executable, "-m", "splitserve.cli", "bench", "serve", "--base-url", server.url,
        "--dataset", "random", "--random-input-len", str(input_len),
        "--random-output-len", str(output_len), "--ignore-eos", "--num-prompts", str(prompts),
        "--request-rate", str(rate), "--seed", str(seed), "--slo-ttft-ms", str(SLO_TTFT_MS),
        "--slo-tpot-ms", str(SLO_TPOT_MS), "--metric-percentiles", "90,99",
        "--tokenizer", args.model,
        "--result-file", str(path), "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    record = json.loads(path.read_text())
    record["phases"] = phase_table(before, phase_totals(server.url))
    record["slo_share"] = _slo_share(record)
    path.write_text(json.dumps(record, indent=2) + "\n")
    record.pop("details", None)
    return record


def _prompts(args: argparse.Namespace, rate: float) -> int:
    if args.seconds_per_rate is None or rate == float("inf"):
        return int(args.num_prompts)
    return min(args.num_prompts, max(20, math.ceil(rate * args.seconds_per_rate)))


def _slo_share(record: dict[str, Any]) -> float:
    """The share of all requests (failed ones count as missing) that met the SLO."""
    total = record["completed"] + record["failed"]
    return record["goodput"] * record["duration"] / total if total else 0.0


def _goodput(runs: list[dict[str, Any]]) -> float:
    """The highest finite Poisson rate at which SLO_SHARE of the requests met the SLO."""
    met = [r["request_rate"] for r in runs if r["slo_share"] >= SLO_SHARE]
    finite = [r for r in met if r != "inf"]
    return max(finite, default=0.0)


def _offline(args: argparse.Namespace, input_len: int, output_len: int) -> dict[str, Any]:
    """The engine alone on the mix: every prompt at once, output tokens per second."""
    # As many prompts as each served rate: the same prefill and the same decode tail.
    prompts = 8 if args.quick else (args.offline_prompts or args.num_prompts)
    command = [
        sys.executable, "-m", "benchmarks.served.offline_mix",
        "--model", args.model, "--device", args.device, "--prompts", str(prompts),
        "--input-len", str(input_len), "--output-len", str(output_len),
    ]  # fmt: skip
    engine = "pools.*.engine."  # the deployment's engine settings hold offline too
    command += [f"--engine={o[len(engine) :]}" for o in args.overrides if o.startswith(engine)]
    done = subprocess.run(command, check=True, capture_output=True, text=True, cwd=REPO)
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _print(summary: dict[str, Any]) -> None:
    print("\nmix        deployment    rate   out tok/s  TTFT mean/p99 ms   TPOT mean/p99 ms  SLO%")
    for name, deployment in summary["deployments"].items():
        for mix, data in deployment["mixes"].items():
            for r in data["runs"]:
                print(
                    f"{mix:10} {name:12} {r['request_rate']!s:>6} {r['output_throughput']:10.0f}"
                    f"  {_ms(r, 'ttft')}  {_ms(r, 'tpot')}  {100 * r['slo_share']:4.0f}"
                )
                print("    " + describe(r["phases"]).replace("\n", "\n    "))
            print(f"{mix:10} {name:12} goodput {data['goodput_rate']:g} req/s")
        first = deployment["first_vs_hundredth"]
        print(f"{name}: ready in {deployment['ready_s']:.1f} s; request 1 {first['first_s']:.3f} s,"
              f" request {first['count']} {first['last_s']:.3f} s")  # fmt: skip
    for mix, offline in summary["offline"].items():
        print(f"offline {mix}: {offline['output_throughput']:.0f} output tok/s")


def _ms(record: dict[str, Any], name: str) -> str:
    mean, p99 = record.get(f"mean_{name}_ms"), record.get(f"p99_{name}_ms")
    if mean is None or p99 is None:
        return f"{'-':>17}"
    return f"{mean:8.1f} / {p99:7.1f}"


if __name__ == "__main__":
    sys.exit(main())
