"""The KV cache system served: prefix caching on against off, and the host tier's hit path.

Three colocated deployments of one model, each started once with `splitserve serve` and
driven by `splitserve bench serve` (the shape's own tokenizer), in one run:

- ``on`` and ``off`` (``enable_prefix_caching``): a shared-prefix workload (few long system
  prompts, many users) and a multi-turn one (conversations that grow each turn), each at a
  Poisson rate (TTFT) and at saturation (throughput);
- ``host``: prefix caching on with the device cache cut to ``--host-device-blocks`` and a host
  tier that holds every prefix; more system prompts than the device holds, two users each,
  user-major, so the second user of a prompt finds it in the host tier only. Its TTFT is
  compared with the first users' (computed) in the same run.

Prompt tokens served from each cache tier come from /metrics around every run. Writes
kv-cache.json (config, commit, every run) to --out and each bench record (per-request
timings too) to --out/runs, and prints a table.

    python -m benchmarks.served.kv_cache                  # one GPU, shape:llama3-8b
    python -m benchmarks.served.kv_cache --quick          # CPU, shape:tiny-llama, 2 minutes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from statistics import mean
from typing import Any

import httpx

from benchmarks.served.process import Server, set_args
from splitserve.bench.report import header

HITS_METRIC = "splitserve:prefix_cache_hits_total"
QUERIES_METRIC = "splitserve:prefix_cache_queries_total"


@dataclass(frozen=True)
class Sizes:
    """Token and request counts of the workloads (QUICK: the CPU's)."""

    system_len: int = 4096
    question_len: int = 128
    prefixes: int = 8
    users: int = 8
    turn_len: int = 512
    conversations: int = 16
    turns: int = 4
    output_len: int = 128
    host_prefixes: int = 16
    host_output_len: int = 16


QUICK = Sizes(
    system_len=256, question_len=8, prefixes=2, users=3, turn_len=32, conversations=2, turns=3,
    output_len=8, host_prefixes=6, host_output_len=4,
)  # fmt: skip


def main() -> int:
    args = _parse()
    out = Path(args.out or os.environ.get("OUT") or "benchmarks/results")
    out.mkdir(parents=True, exist_ok=True)
    sizes = QUICK if args.quick else Sizes()
    record: dict[str, Any] = header({**vars(args), "sizes": vars(sizes)})
    record["deployments"] = {}
    for name, sets, workloads in _plan(args, sizes):
        print(f"== {name}: {' '.join(sets)}", flush=True)
        with Server(["--config", args.config, *sets]) as server:
            runs = [_bench(args, out, server, name, *w) for w in workloads]
        record["deployments"][name] = {"serve_args": sets, "ready_s": server.ready_s, "runs": runs}
        (out / "kv-cache.json").write_text(json.dumps(record, indent=2) + "\n")
    _print(record)
    return 0


def _parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default shape:llama3-8b, tiny with --quick")
    parser.add_argument("--config", default=None, help="default configs/gpu-colocated.yaml")
    parser.add_argument("--rate", type=float, default=4.0, help="Poisson req/s of the TTFT runs")
    parser.add_argument("--host-device-blocks", type=int, help="default 2048, 48 with --quick")
    parser.add_argument("--host-batched-tokens", type=int, default=1024, help="host run's steps")
    parser.add_argument("--quick", action="store_true", help="tiny run on the CPU")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    quick = args.quick
    args.model = args.model or ("shape:tiny-llama" if quick else "shape:llama3-8b")
    args.config = args.config or f"configs/{'colocated' if quick else 'gpu-colocated'}.yaml"
    args.host_device_blocks = args.host_device_blocks or (48 if quick else 2048)
    return args


def _plan(
    args: argparse.Namespace, s: Sizes
) -> list[tuple[str, list[str], list[tuple[str, list[str], float, int]]]]:
    """(deployment, its --set arguments, [(workload, bench arguments, rate, prompts)]).

    Each workload's rate and saturation runs draw their own prompts (seeds 0 and 1), the same
    in every deployment. Saturation keeps a cap on requests in flight so that a conversation's
    next turn mostly comes after its last one, as a client's would."""
    engine = "pools.colocated.engine"
    shared = [
        "--dataset", "shared-prefix", "--shared-prefix-num-prefixes", str(s.prefixes),
        "--shared-prefix-users", str(s.users), "--shared-prefix-system-len", str(s.system_len),
        "--shared-prefix-question-len", str(s.question_len), "--output-len", str(s.output_len),
    ]  # fmt: skip
    turns = [
        "--dataset", "multi-turn", "--multi-turn-conversations", str(s.conversations),
        "--multi-turn-turns", str(s.turns), "--multi-turn-turn-len", str(s.turn_len),
        "--output-len", str(s.output_len),
    ]  # fmt: skip
    host = [
        "--dataset", "shared-prefix", "--shared-prefix-num-prefixes", str(s.host_prefixes),
        "--shared-prefix-users", "2", "--shared-prefix-system-len", str(s.system_len),
        "--shared-prefix-question-len", str(s.question_len),
        "--output-len", str(s.host_output_len), "--seed", "0",
    ]  # fmt: skip
    inf, cap = float("inf"), ["--max-concurrency", str(s.conversations)]
    both = [
        ("shared-prefix", [*shared, "--seed", "0"], args.rate, s.prefixes * s.users),
        ("shared-prefix", [*shared, "--seed", "1", *cap], inf, s.prefixes * s.users),
        ("multi-turn", [*turns, "--seed", "0"], args.rate, s.conversations * s.turns),
        ("multi-turn", [*turns, "--seed", "1", *cap], inf, s.conversations * s.turns),
    ]
    model = [f"model={args.model}"]
    # The host tier holds every prompt of the host run (at fp32's size: twice over in bf16);
    # one step's write-through is capped by the pinned staging slabs (256 MiB, docs/kvstore.md),
    # so that deployment's steps stay small enough for a step's blocks to fit.
    host_bytes = 2 * s.host_prefixes * (s.system_len + s.question_len) * _kv_bytes(args.model)
    host_sets = [
        *model, f"{engine}.num_kv_blocks={args.host_device_blocks}",
        f"{engine}.max_num_batched_tokens={args.host_batched_tokens}",
        f"kv_store.host_bytes={host_bytes}",
    ]  # fmt: skip
    return [
        ("on", set_args([*model, f"{engine}.enable_prefix_caching=true"]), both),
        ("off", set_args([*model, f"{engine}.enable_prefix_caching=false"]), both),
        ("host", set_args(host_sets), [("host-tier", host, args.rate, 2 * s.host_prefixes)]),
    ]


def _kv_bytes(model: str) -> int:
    """KV bytes per token of the model in fp32 (K and V of every layer)."""
    from splitserve.engine.loader import load_model_config, resolve_model

    c = load_model_config(resolve_model(model))
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * 4


def _bench(
    args: argparse.Namespace,
    out: Path,
    server: Server,
    deployment: str,
    workload: str,
    dataset: list[str],
    rate: float,
    prompts: int,
) -> dict[str, Any]:
    tag = f"{deployment}-{workload}-{'sat' if rate == float('inf') else f'{rate:g}'}"
    path = out / "runs" / f"serve-{tag}.json"
    before = tier_tokens(server.url)
    command = [
        sys.executable, "-m", "splitserve.cli", "bench", "serve", "--base-url", server.url,
        "--endpoint", "chat", "--tokenizer", args.model, *dataset, "--ignore-eos",
        "--num-prompts", str(prompts), "--request-rate", str(rate),
        "--result-file", str(path), "--disable-tqdm", "--save-detailed",
    ]  # fmt: skip
    subprocess.run(command, check=True)
    run = json.loads(path.read_text())
    after = tier_tokens(server.url)
    run["cache_tokens"] = {k: after[k] - before.get(k, 0.0) for k in after}
    run["workload"], run["deployment"] = workload, deployment
    ttfts = run["details"]["ttfts"]
    if workload == "host-tier":  # first half: each prompt's first user; second: host hits
        half = len(ttfts) // 2
        run["first_user_mean_ttft_ms"] = _mean_ms(ttfts[:half])
        run["second_user_mean_ttft_ms"] = _mean_ms(ttfts[half:])
    path.write_text(json.dumps(run, indent=2) + "\n")
    run.pop("details")
    return run


def _mean_ms(seconds: list[float | None]) -> float | None:
    done = [s for s in seconds if s is not None]
    return 1000.0 * mean(done) if done else None


def tier_tokens(url: str) -> dict[str, float]:
    """Prompt tokens looked up ("queried") and served per tier, summed over the workers."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(QUERIES_METRIC + "{"):
            totals["queried"] = totals.get("queried", 0.0) + float(line.rsplit(" ", 1)[1])
        elif line.startswith(HITS_METRIC + "{"):
            tier = line.split('tier="', 1)[1].split('"', 1)[0]
            totals[tier] = totals.get(tier, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def _print(record: dict[str, Any]) -> None:
    print(
        "\ndeployment workload       rate   req/s  out tok/s  TTFT mean/p99 ms"
        "      hit tokens device/host of queried"
    )
    for name, deployment in record["deployments"].items():
        for r in deployment["runs"]:
            tokens = r["cache_tokens"]
            print(
                f"{name:10} {r['workload']:14} {r['request_rate']!s:>5} "
                f"{r['request_throughput']:6.2f} {r['output_throughput']:10.0f} "
                f"{r['mean_ttft_ms']:9.1f} / {r['p99_ttft_ms']:7.1f}   "
                f"{tokens.get('device', 0):.0f}/{tokens.get('host', 0):.0f} "
                f"of {tokens.get('queried', 0):.0f}"
            )
            if "second_user_mean_ttft_ms" in r:
                print(
                    f"{'':10} first users {r['first_user_mean_ttft_ms']:.1f} ms (computed),"
                    f" second users {r['second_user_mean_ttft_ms']:.1f} ms (host tier)"
                )


if __name__ == "__main__":
    sys.exit(main())
