"""A tiny DeepSeek-V3 checkpoint served by real deployments: 2 prefill workers with a Redis
prefix index (cache-aware with a disk tier; in
turn without a store). Served text equals the offline engine's (which equals transformers',
tests/test_deepseek_engine.py); a second turn computes only its new tokens, on the holder of
its prefix (routed there by the index), or on the other prefill worker, which pulls the latent
blocks from the holder that the index names."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.kvstore.hashing import hash_root
from tests.support.prefix_counters import (
    WORKERS,
    chosen,
    counters,
    reused,
    settled_delta,
    wait_indexed,
)
from tests.support.redis_process import RedisProcess
from tests.support.server_process import ServerProcess, serve
from tests.support.tiny_models import tiny_deepseek_v3, tiny_llm

pytestmark = pytest.mark.slow
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def checkpoint(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> str:
    return tiny_deepseek_v3(smollm2_tokenizer, tmp_path_factory.mktemp("v3") / "v3")[1]


@pytest.fixture(scope="module")
def offline(checkpoint: str, smollm2_tokenizer: Any) -> LLM:
    return tiny_llm(checkpoint, smollm2_tokenizer, max_model_len=2048)


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def complete(url: str, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert response.status_code == 200, response.text
    return str(response.json()["choices"][0]["text"])


def expected(llm: LLM, prompt: list[int]) -> str:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisProcess]:
    server = RedisProcess(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cached(
    checkpoint: str, redis_server: RedisProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    with serve(
        f"model={checkpoint}",
        "pools.prefill.replicas=2",
        f"prefix_index.url={redis_server.url}",
        "prefix_index.publish_interval_s=0.2",
        "kv_store.host_bytes=0",
        f"kv_store.disk_path={tmp_path_factory.mktemp('kv-disk')}",
    ) as process:
        yield process


def measured(url: str, model: str, prompt: list[int]) -> tuple[str, dict]:
    before = counters(url)
    text = complete(url, model, prompt)
    return text, settled_delta(url, before, len(prompt))


def test_turn_2_goes_to_the_holder_and_computes_only_its_new_tokens(
    checkpoint: str, cached: ServerProcess, redis_server: RedisProcess, offline: LLM
) -> None:
    turn1 = ids(150, 10)
    text, d1 = measured(cached.url, checkpoint, turn1)
    assert text == expected(offline, turn1)
    holder = chosen(d1)
    wait_indexed(redis_server.url, turn1, holder, hash_root(checkpoint, "float32", 16))
    turn2 = turn1 + ids(30, 11)
    text2, d2 = measured(cached.url, checkpoint, turn2)
    assert text2 == expected(offline, turn2)
    assert chosen(d2) == holder
    assert d2[holder]["device"] == reused(turn1, turn2) == 144
    assert d2[holder]["computed"] == len(turn2) - 144


@pytest.fixture(scope="module")
def alternating(checkpoint: str, redis_server: RedisProcess) -> Iterator[ServerProcess]:
    """2 prefill workers taking requests in turn, a Redis index, no block store."""
    with serve(
        f"model={checkpoint}",
        "pools.prefill.replicas=2",
        "router.policy=round_robin",
        f"prefix_index.url={redis_server.url}",
        "prefix_index.publish_interval_s=0.2",
        "kv_store.host_bytes=0",
    ) as process:
        yield process


def test_the_other_prefill_worker_pulls_the_latent_prefix_from_its_holder(
    checkpoint: str, alternating: ServerProcess, redis_server: RedisProcess, offline: LLM
) -> None:
    """The index names the holder of turn 1's blocks; turn 2 goes to the other worker in
    turn, which pulls those latent blocks from the holder's device and computes the rest."""
    turn1 = ids(144, 20)
    _, d1 = measured(alternating.url, checkpoint, turn1)
    holder = chosen(d1)
    other = next(w for w in WORKERS if w != holder)
    wait_indexed(redis_server.url, turn1, holder, hash_root(checkpoint, "float32", 16))
    turn2 = turn1 + ids(20, 22)
    text2, d2 = measured(alternating.url, checkpoint, turn2)
    assert text2 == expected(offline, turn2)
    assert chosen(d2) == other
    assert d2[other]["remote"] == reused(turn1, turn2) == 144
    assert d2[other]["computed"] == len(turn2) - 144
