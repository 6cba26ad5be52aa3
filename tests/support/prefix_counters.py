"""Per-worker prefix cache counters from /metrics, and the prompts the KV cache tests share."""

from __future__ import annotations

import re
from typing import Any

import httpx
import redis

from splitserve.kvstore.hashing import block_hashes
from tests.support.wait import wait_for

WORKERS = ("prefill-0", "prefill-1")
TIERS = ("device", "host", "disk", "remote")


def counters(url: str) -> dict[tuple[str, str], float]:
    """(worker, "queries" | tier) -> prompt tokens, for the prefill workers."""
    result: dict[tuple[str, str], float] = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        match = re.match(r"splitserve:prefix_cache_(queries|hits)_total\{(.*)\} (\S+)", line)
        if match is None:
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2)))
        key = "queries" if match.group(1) == "queries" else labels["tier"]
        result[(labels["worker"], key)] = float(match.group(3))
    return result


def delta(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float]) -> dict:
    """worker -> {"queries", "device", "host", "disk", "remote", "computed"} increments."""
    out = {}
    for worker in WORKERS:
        d = {
            k: after.get((worker, k), 0.0) - before.get((worker, k), 0.0)
            for k in ("queries", *TIERS)
        }
        d["computed"] = d["queries"] - sum(d[tier] for tier in TIERS)
        out[worker] = d
    return out


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def reused(first: list[int], second: list[int]) -> int:
    """Prompt tokens of ``second`` whose KV the first prompt's full blocks provide."""
    common = 0
    for a, b in zip(first, second):
        if a != b:
            break
        common += 1
    return min(common // 16, len(first) // 16, (len(second) - 1) // 16) * 16


def system_prompt(topic: str, sentences: int) -> str:
    return " ".join(
        f"Rule {i} about {topic}: answer briefly and stay polite." for i in range(sentences)
    )


def chosen(d: dict) -> str:
    """The prefill worker that computed the request (the only one whose queries moved)."""
    workers = [w for w in WORKERS if d[w]["queries"] > 0]
    assert len(workers) == 1, d
    return workers[0]


def settled_delta(url: str, before: dict[tuple[str, str], float], prompt_tokens: int) -> dict:
    """The counters' increments since ``before``, once the prefill workers' stats (sent every
    0.2 s in the tests' deployments) count ``prompt_tokens`` more prompt tokens looked up."""

    def queried() -> float:
        return sum(d["queries"] for d in delta(before, counters(url)).values())

    wait_for(
        lambda: queried() >= prompt_tokens,
        10,
        message=lambda: f"{prompt_tokens} prompt tokens in the stats (now {queried():g})",
    )
    return delta(before, counters(url))


def wait_indexed(redis_url: str, ids: list[int], holder: str, root: int) -> None:
    """Until the Redis prefix index lists ``holder`` with every full block of ``ids`` (block
    hashes from ``root``, blocks of 16) on its device: what cache-aware routing reads."""
    client = redis.Redis.from_url(redis_url)
    keys = [f"splitserve:kv:b:{h:016x}" for h in block_hashes(ids, 16, root)]
    field = f"{holder}@device"
    wait_for(
        lambda: all(client.hexists(key, field) for key in keys),
        10,
        message=f"{len(keys)} blocks indexed for {field}",
    )
    client.close()
