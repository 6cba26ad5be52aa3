"""The KV cache system end to end: 2 prefill workers + 1 decode worker, a Redis prefix index,
a disk tier shared by both prefill workers (host tier off, so every stored block is on disk).

Per-worker counters come from /metrics: prefix_cache_queries (prompt tokens looked up) and
prefix_cache_hits{tier} (prompt tokens served from device, host or disk).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from splitserve.kvstore.hashing import block_hashes, hash_root
from tests.support.prefix_counters import (
    WORKERS,
    chosen,
    counters,
    prompt_ids,
    reused,
    settled_delta,
    system_prompt,
    wait_indexed,
)
from tests.support.redis_process import RedisProcess
from tests.support.server_process import ServerProcess, metric, serve
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
MAX_TOKENS = 8
ROOT = hash_root(MODEL, "float32", 16)  # the default deployment's: CPU, fp32, blocks of 16


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kv-disk")


@pytest.fixture(scope="module")
def server(redis_server: RedisProcess, disk: Path) -> Iterator[ServerProcess]:
    with serve(
        "pools.prefill.replicas=2",
        f"prefix_index.url={redis_server.url}",
        "prefix_index.publish_interval_s=0.2",
        "kv_store.host_bytes=0",
        f"kv_store.disk_path={disk}",
        "kv_store.retention.agent=2",
    ) as process:
        yield process


def chat(url: str, messages: list[dict[str, str]], headers: dict[str, str] | None = None) -> str:
    body = {"model": MODEL, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=300)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["message"]["content"])


def measured(url: str, messages: list[dict[str, str]], tokenizer: Any) -> tuple[str, dict]:
    before = counters(url)
    text = chat(url, messages)
    return text, settled_delta(url, before, len(prompt_ids(tokenizer, messages)))


def reference(llm: LLM, messages: list[dict[str, str]]) -> str:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    return llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text


def test_unknown_traffic_class_is_400(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    response = httpx.post(
        f"{server.url}/v1/chat/completions", json=body, headers={"x-traffic-class": "batch"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "x-traffic-class"


def test_turn_2_goes_to_turn_1_replica_and_computes_only_new_tokens(
    server: ServerProcess, redis_server: RedisProcess, smollm2_llm: LLM, smollm2_tokenizer: Any
) -> None:
    turn1 = [
        {"role": "system", "content": system_prompt("gardens", 12)},
        {"role": "user", "content": "Name a flower."},
    ]
    answer, d1 = measured(server.url, turn1, smollm2_tokenizer)
    assert answer == reference(smollm2_llm, turn1)
    holder = chosen(d1)
    ids1 = prompt_ids(smollm2_tokenizer, turn1)
    wait_indexed(redis_server.url, ids1, holder, ROOT)
    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And a tree?"})
    answer2, d2 = measured(server.url, turn2, smollm2_tokenizer)
    assert answer2 == reference(smollm2_llm, turn2)
    assert chosen(d2) == holder
    ids2 = prompt_ids(smollm2_tokenizer, turn2)
    cached = reused(ids1, ids2)
    assert cached >= 160
    assert d2[holder]["device"] == cached
    assert d2[holder]["computed"] == len(ids2) - cached


def test_saturated_holder_sends_turn_2_to_other_replica_which_loads_prefix_from_disk(
    server: ServerProcess, redis_server: RedisProcess, smollm2_llm: LLM, smollm2_tokenizer: Any
) -> None:
    turn1 = [
        {"role": "system", "content": system_prompt("rivers", 40)},
        {"role": "user", "content": "Name a river."},
    ]
    answer, d1 = measured(server.url, turn1, smollm2_tokenizer)
    holder = chosen(d1)
    other = next(w for w in WORKERS if w != holder)
    ids1 = prompt_ids(smollm2_tokenizer, turn1)
    wait_indexed(redis_server.url, ids1, holder, ROOT)
    # Saturate the holder: one request that shares its prefix and adds twice as many new
    # tokens. Cache-aware routing sends it there (cheaper than computing everything on the
    # other replica), and while it runs the holder's queue exceeds turn 2's whole prompt.
    tail = system_prompt("unrelated matters", 2 * len(ids1) // 14)
    burst = [turn1[0], {"role": "user", "content": tail}]
    before = counters(server.url)
    thread = threading.Thread(target=chat, args=(server.url, burst))
    thread.start()
    wait_for(
        lambda: metric(server.url, "splitserve:num_requests_admitted") >= 1,
        10,
        message="the burst admitted, so routed and counted in the holder's queue",
    )
    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And a lake?"})
    answer2 = chat(server.url, turn2)
    thread.join()
    ids2 = prompt_ids(smollm2_tokenizer, turn2)
    d = settled_delta(server.url, before, len(prompt_ids(smollm2_tokenizer, burst)) + len(ids2))
    cached = reused(ids1, ids2)
    assert answer2 == reference(smollm2_llm, turn2)
    assert d[holder]["queries"] == len(prompt_ids(smollm2_tokenizer, burst))
    assert d[other]["queries"] == len(ids2)
    assert d[other]["disk"] == cached
    assert d[other]["computed"] == len(ids2) - cached


def test_block_past_its_retention_is_gone(
    server: ServerProcess, disk: Path, smollm2_tokenizer: Any
) -> None:
    messages = [{"role": "user", "content": system_prompt("short-lived agent notes", 8)}]
    chat(server.url, messages, headers={"x-traffic-class": "agent"})
    hashes = block_hashes(prompt_ids(smollm2_tokenizer, messages), 16, ROOT)
    files = [disk / f"{h:016x}"[:2] / f"{h:016x}.kv" for h in hashes]
    assert all(f.exists() for f in files)
    wait_for(
        lambda: not any(f.exists() for f in files),
        3.5,
        interval=0.1,
        message="the agent blocks' files deleted after their 2 s retention",
    )


def test_redis_outage_fails_no_request_and_restart_restores_cache_aware_routing(
    server: ServerProcess, redis_server: RedisProcess, smollm2_llm: LLM, smollm2_tokenizer: Any
) -> None:
    turn1 = [
        {"role": "system", "content": system_prompt("mountains", 12)},
        {"role": "user", "content": "Name a peak."},
    ]
    answer = chat(server.url, turn1)
    redis_server.stop()
    try:
        for i in range(3):
            messages = [{"role": "user", "content": f"Outage question {i}: name a colour."}]
            assert chat(server.url, messages) == reference(smollm2_llm, messages)
    finally:
        redis_server.start()
    client = redis.Redis.from_url(redis_server.url)

    def fields() -> set[str]:
        return {f.decode() for key in client.keys("splitserve:kv:b:*") for f in client.hgetall(key)}

    wait_for(
        lambda: {f"{w}@device" for w in WORKERS} <= fields(),
        17,
        interval=0.2,
        message=lambda: f"both prefill workers' blocks rebuilt in Redis (fields: {fields()})",
    )
    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And a valley?"})
    answer2, d = measured(server.url, turn2, smollm2_tokenizer)
    assert answer2 == reference(smollm2_llm, turn2)
    assert d[chosen(d)]["device"] > 0
