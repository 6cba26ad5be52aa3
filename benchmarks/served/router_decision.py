"""Cost of one routing decision against a filled prefix index.

Fills an index with ``--blocks`` distinct blocks (default 100k) spread over 8 prefill workers:
conversations of up to 128 blocks (2,048 tokens at block size 16) that share one of 16 system
prompts, each cached on one or two workers with a random part of its tail evicted. Each timed
request reuses a random prefix of a random conversation plus fresh blocks, and the decision is
``longest_prefixes`` + ``cache_aware`` prefill choice + decode choice. Block hashing is not
timed: the API server computes the hashes before it asks the router.

    .venv/bin/python -m benchmarks.served.router_decision                # memory index
    .venv/bin/python -m benchmarks.served.router_decision --start-redis  # and a redis-server

Writes benchmarks/results/router-decision-vm2c/router_decision.json (or --out) with the commit
and the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

ROOT = Path(__file__).resolve().parents[2]

from splitserve.kvstore.hashing import block_hashes  # noqa: E402
from splitserve.kvstore.index import MemoryPrefixIndex, PrefixIndex  # noqa: E402
from splitserve.kvstore.redis_index import RedisPrefixIndex  # noqa: E402
from splitserve.router.policy import Candidate, RequestInfo, make_policy  # noqa: E402

BLOCK = 16
HOLDERS = [f"prefill-{i}" for i in range(8)]
SYSTEM_BLOCKS, CONV_BLOCKS, NUM_SYSTEMS = 32, 96, 16


def conversations(num_blocks: int, rng: random.Random) -> list[list[int]]:
    """Token ids of conversations whose distinct full blocks add up to about num_blocks."""
    systems = [
        [rng.randrange(50_000) for _ in range(SYSTEM_BLOCKS * BLOCK)] for _ in range(NUM_SYSTEMS)
    ]
    count = max(1, (num_blocks - NUM_SYSTEMS * SYSTEM_BLOCKS) // CONV_BLOCKS)
    return [
        rng.choice(systems) + [rng.randrange(50_000) for _ in range(CONV_BLOCKS * BLOCK)]
        for _ in range(count)
    ]


def fill(index: PrefixIndex, chains: list[list[int]], rng: random.Random) -> int:
    """Publish every chain on one or two workers, each missing a random tail; returns blocks."""
    distinct: set[int] = set()
    for chain in chains:
        for holder in rng.sample(HOLDERS, rng.choice((1, 2))):
            kept = chain[: rng.randrange(SYSTEM_BLOCKS, len(chain) + 1)]
            index.publish(holder, rng.choice(("device", "host")), kept, ())
        distinct.update(chain)
    return len(distinct)


def requests(token_chains: list[list[int]], count: int, rng: random.Random) -> list[list[int]]:
    """Hashes of prompts: a random prefix of a random conversation, then fresh blocks."""
    prompts = []
    for _ in range(count):
        tokens = rng.choice(token_chains)[
            : rng.randrange(1, SYSTEM_BLOCKS + CONV_BLOCKS + 1) * BLOCK
        ]
        tokens = tokens + [rng.randrange(50_000) for _ in range(rng.randrange(0, 33) * BLOCK)]
        prompts.append(tokens)
    return prompts


def time_decisions(index: PrefixIndex, prompts: list[list[int]], rng: random.Random) -> list[float]:
    """Microseconds per decision: index lookup, prefill choice, decode choice."""
    policy = make_policy("cache_aware")
    workers = [
        Candidate(h, rng.randrange(100), rng.randrange(16), 0, True, rng.randrange(4096), 5000.0)
        for h in HOLDERS
    ]
    hashes = [block_hashes(p, BLOCK) for p in prompts]
    times = []
    for prompt, prompt_hashes in zip(prompts, hashes):
        start = time.perf_counter_ns()
        found = index.longest_prefixes(prompt_hashes)
        info = RequestInfo("r", prompt, BLOCK, {h: n for h, (n, _) in found.items()})
        policy.choose_prefill(workers, info)
        policy.choose_decode(workers, info)
        times.append((time.perf_counter_ns() - start) / 1e3)
    return times


def summary(times: Sequence[float]) -> dict[str, float]:
    ordered = sorted(times)
    return {
        "mean_us": round(statistics.fmean(ordered), 2),
        "p50_us": round(ordered[len(ordered) // 2], 2),
        "p99_us": round(ordered[int(len(ordered) * 0.99)], 2),
        "max_us": round(ordered[-1], 2),
    }


def start_redis(directory: str) -> tuple[subprocess.Popen[bytes], str]:
    """A private redis-server on a free loopback port, without persistence."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
    args += ["--appendonly", "no", "--dir", directory]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(200):
        try:
            redis.Redis.from_url(url).ping()
            break
        except redis.ConnectionError:
            time.sleep(0.02)
    return proc, url


def run(index: PrefixIndex, chains: list[list[int]], args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    hashed = [block_hashes(c, BLOCK) for c in chains]
    start = time.perf_counter()
    blocks = fill(index, hashed, rng)
    fill_s = time.perf_counter() - start
    times = time_decisions(index, requests(chains, args.requests, rng), rng)
    return {"indexed_blocks": blocks, "fill_s": round(fill_s, 2), **summary(times)}


def commit() -> str | None:
    out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, check=False)
    return out.stdout.decode().strip() or None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=100_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", help="also time a RedisPrefixIndex at this URL")
    parser.add_argument("--start-redis", action="store_true", help="start a private redis-server")
    parser.add_argument(
        "--out", default=str(ROOT / "benchmarks/results/router-decision-vm2c/router_decision.json")
    )
    args = parser.parse_args()
    chains = conversations(args.blocks, random.Random(args.seed))
    results = {"memory": run(MemoryPrefixIndex(), chains, args)}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = start_redis(tmp) if args.start_redis else (None, args.redis_url)
        try:
            if url:
                ns = f"bench:{os.getpid()}"
                results["redis"] = run(RedisPrefixIndex(url, 3600.0, namespace=ns), chains, args)
        finally:
            if proc is not None:
                proc.terminate()
                proc.wait()
    report = {
        "benchmark": "router_decision",
        "commit": commit(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"holders": len(HOLDERS)},
        "results": results,
    }
    for name, row in results.items():
        print(f"{name:7} blocks={row['indexed_blocks']} mean={row['mean_us']}µs "
              f"p50={row['p50_us']}µs p99={row['p99_us']}µs max={row['max_us']}µs")  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
