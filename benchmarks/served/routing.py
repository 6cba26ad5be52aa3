"""Cache-aware routing against round robin on a shared-prefix workload, in one run.

Starts the 2-prefill + 1-decode CPU deployment once per policy and round, warms it up with a
few unrelated requests, drives it with `splitserve bench serve --dataset shared-prefix`
(Poisson arrivals) and reads the prefix cache counters from /metrics before and after. Rounds
alternate the order (A B, then B A, ...) so that neither policy always runs first on a cold
machine. Writes one JSON with every run, the per-policy means, the config and the commit
(default benchmarks/results/routing-vm2c/shared-prefix.json).

    python -m benchmarks.served.routing --num-prompts 200 --request-rate 2 --rounds 2
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[2]
POLICIES = ("cache_aware", "round_robin")
SERVE = [sys.executable, "-m", "splitserve.cli", "serve", "--set", "pools.prefill.replicas=2"]
BENCH = [sys.executable, "-m", "splitserve.cli", "bench", "serve", "--endpoint", "chat"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prefixes", type=int, default=10)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--question-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--rounds", type=int, default=2, help="runs per policy, order alternating")
    parser.add_argument("--warmup", type=int, default=4, help="unmeasured requests per server")
    parser.add_argument("--set", action="append", default=[], help="extra serve --set overrides")
    parser.add_argument(
        "--result-file",
        type=Path,
        default=REPO / "benchmarks/results/routing-vm2c/shared-prefix.json",
    )
    args = parser.parse_args()
    runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        order = POLICIES if round_ % 2 == 0 else tuple(reversed(POLICIES))
        runs += [run(policy, args) | {"round": round_} for policy in order]
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    summary = {policy: _mean_of(policy, runs) for policy in POLICIES}
    record = {
        "commit": commit,
        "config": vars(args) | {"result_file": str(args.result_file)},
        "runs": runs,
        "summary": summary,
    }
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(record, indent=2) + "\n")
    for r in [*runs, *summary.values()]:
        policy = r["policy"] if "round" not in r else f"{r['policy']} (round {r['round']})"
        print(
            f"{policy}: hit rate {r['hit_rate']:.3f}, TTFT mean {r['mean_ttft_ms']:.1f} ms, "
            f"p99 {r['p99_ttft_ms']:.1f} ms, {r['completed']} done, {r['failed']} failed, "
            f"by prefill worker {r['requests_by_prefill_worker']}"
        )
    print(f"results: {args.result_file}")
    return 0


def run(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [*SERVE, "--port", str(port), "--set", f"router.policy={policy}", *_sets(args)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_ready(server, url)
        # Keep draining the server's output: a full pipe would block its request log.
        log: list[dict[str, Any]] = []
        threading.Thread(target=_drain, args=(server, log), daemon=True).start()
        _warm_up(url, args.warmup)
        warmup_entries = len(log)
        before = _counters(url)
        out = REPO / f"benchmarks/results/.shared-prefix-{policy}.json"
        subprocess.run(
            [*BENCH, "--base-url", url, *_dataset_args(args), "--result-file", str(out)],
            cwd=REPO,
            check=True,
        )
        time.sleep(1.0)
        after = _counters(url)
        bench = json.loads(out.read_text())
        out.unlink()
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=120)
    hits = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("device", "host", "disk", "remote")}
    queries = after.get("queries", 0.0) - before.get("queries", 0.0)
    return {
        "policy": policy,
        "prompt_tokens_queried": queries,
        "hit_tokens_by_tier": hits,
        "hit_rate": sum(hits.values()) / queries if queries else 0.0,
        **{k: v for k, v in bench.items() if k.endswith("ttft_ms")},
        "request_throughput": bench.get("request_throughput"),
        "requests_by_prefill_worker": _by_worker(log[warmup_entries:]),
        "completed": bench.get("completed"),
        "failed": bench.get("failed"),
        "bench": bench,
    }


def _sets(args: argparse.Namespace) -> list[str]:
    return [word for item in args.set for word in ("--set", item)]


def _warm_up(url: str, count: int) -> None:
    """A few requests that share nothing with the benchmark's prompts: first-call costs
    (allocation, lazy initialisation) are paid before anything is measured."""
    for i in range(count):
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": f"Warm-up {i}: name a colour."}],
            "max_tokens": 4,
        }
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).raise_for_status()


def _mean_of(policy: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """A policy's runs averaged: hit rate, TTFT and throughput."""
    mine = [r for r in runs if r["policy"] == policy]
    keys = ("hit_rate", "mean_ttft_ms", "p99_ttft_ms", "request_throughput")
    return {
        "policy": policy,
        "runs": len(mine),
        **{k: sum(r[k] for r in mine) / len(mine) for k in keys},
        "completed": sum(r["completed"] for r in mine),
        "failed": sum(r["failed"] for r in mine),
        "requests_by_prefill_worker": {},
    }


def _dataset_args(args: argparse.Namespace) -> list[str]:
    return [
        *("--dataset", "shared-prefix", "--disable-tqdm", "--ignore-eos"),
        *("--shared-prefix-num-prefixes", str(args.num_prefixes)),
        *("--shared-prefix-users", str(args.users)),
        *("--shared-prefix-system-len", str(args.system_len)),
        *("--shared-prefix-question-len", str(args.question_len)),
        *("--output-len", str(args.output_len)),
        *("--num-prompts", str(args.num_prompts), "--request-rate", str(args.request_rate)),
    ]


def _drain(server: subprocess.Popen[str], log: list[dict[str, Any]]) -> None:
    """Read the server's output to its end, keeping the request log entries."""
    assert server.stdout is not None
    prefix = "splitserve request "
    for line in server.stdout:
        if line.startswith(prefix):
            log.append(json.loads(line[len(prefix) :]))


def _by_worker(log: list[dict[str, Any]]) -> dict[str, int]:
    """Finished requests per prefill worker."""
    counts: dict[str, int] = {}
    for entry in log:
        worker = str(entry.get("prefill_worker"))
        counts[worker] = counts.get(worker, 0) + 1
    return dict(sorted(counts.items()))


def _counters(url: str) -> dict[str, float]:
    """Prefix cache counters summed over the workers: "queries" and each hit tier."""
    totals: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(r"splitserve:prefix_cache_(queries|hits)_total\{(.*)\} (\S+)", line)
        if match is None:
            continue
        tier = re.search(r'tier="(\w+)"', match.group(2))
        key = "queries" if match.group(1) == "queries" else (tier.group(1) if tier else "")
        totals[key] = totals.get(key, 0.0) + float(match.group(3))
    return totals


def _wait_ready(server: subprocess.Popen[str], url: str) -> None:
    assert server.stdout is not None
    deadline = time.monotonic() + 240
    for line in server.stdout:
        if line.startswith("splitserve ready:"):
            break
        if time.monotonic() > deadline:
            raise TimeoutError("server not ready")
    while httpx.get(f"{url}/health").status_code != 200:
        time.sleep(0.2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    sys.exit(main())
