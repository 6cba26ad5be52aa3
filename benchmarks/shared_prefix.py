"""Cache-aware routing against round robin on a shared-prefix workload, in one run.

Starts the 2-prefill + 1-decode CPU deployment once per policy, drives it with
`splitserve bench serve --dataset shared-prefix` (Poisson arrivals) and reads the prefix cache
counters from /metrics before and after. Writes one JSON with both runs, the config and the
commit (default benchmarks/results/cpu-shared-prefix.json).

    python benchmarks/shared_prefix.py --num-prompts 200 --request-rate 4
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

REPO = Path(__file__).resolve().parent.parent
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
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument(
        "--result-file", type=Path, default=REPO / "benchmarks/results/cpu-shared-prefix.json"
    )
    args = parser.parse_args()
    runs = {policy: run(policy, args) for policy in POLICIES}
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    record = {"commit": commit, "config": vars(args) | {"result_file": str(args.result_file)}}
    record["runs"] = runs
    args.result_file.parent.mkdir(parents=True, exist_ok=True)
    args.result_file.write_text(json.dumps(record, indent=2) + "\n")
    for policy, r in runs.items():
        print(
            f"{policy}: hit rate {r['hit_rate']:.3f}, TTFT mean {r['mean_ttft_ms']:.1f} ms, "
            f"p99 {r['p99_ttft_ms']:.1f} ms, {r['completed']} done, {r['failed']} failed"
        )
    print(f"results: {args.result_file}")
    return 0


def run(policy: str, args: argparse.Namespace) -> dict[str, Any]:
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [*SERVE, "--port", str(port), "--set", f"router.policy={policy}"],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        _wait_ready(server, url)
        # Keep draining the server's output: a full pipe would block its request log.
        threading.Thread(target=_drain, args=(server,), daemon=True).start()
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
    hits = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in ("device", "host", "disk")}
    queries = after.get("queries", 0.0) - before.get("queries", 0.0)
    return {
        "policy": policy,
        "prompt_tokens_queried": queries,
        "hit_tokens_by_tier": hits,
        "hit_rate": sum(hits.values()) / queries if queries else 0.0,
        **{k: v for k, v in bench.items() if k.endswith("ttft_ms")},
        "completed": bench.get("completed"),
        "failed": bench.get("failed"),
        "bench": bench,
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


def _drain(server: subprocess.Popen[str]) -> None:
    assert server.stdout is not None
    for _ in server.stdout:
        pass


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
