"""Two prefill workers + one decode worker, routed round robin, no disk tier: still colocated
outputs, both prefill workers used, and a chat's turn 2 on the other prefill worker pulls
turn 1's prefix from its peer over the KV transport."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from splitserve.config import PrefixIndexConfig
from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from tests.support.disagg import MODEL, PROMPTS, Reference, completions
from tests.support.prefix_counters import chosen, counters, delta, prompt_ids, reused, system_prompt
from tests.support.server_process import ServerProcess, serve, worker_metric
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
INDEX_PUBLISH_S = PrefixIndexConfig().publish_interval_s + 0.3
"""From a response until the prefill worker's index update with the prompt's blocks has
reached the API server (one publish interval, and a margin for the worker's loop)."""


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve("pools.prefill.replicas=2", "router.policy=round_robin") as process:
        yield process


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_30_prompts_through_2_prefill_workers_equal_colocated(
    server: ServerProcess, prompts_reference: list[Reference], stream: bool
) -> None:
    assert completions(server.url, PROMPTS, stream) == prompts_reference


def test_round_robin_sent_kv_from_both_prefill_workers(server: ServerProcess) -> None:
    completions(server.url, PROMPTS[:4], stream=False)

    def settled() -> bool:
        """Each worker's counters reach the API server with its next statistics (every 0.2 s):
        wait until the sent and the received bytes agree."""
        sent = [worker_metric(server.url, BYTES, w) for w in ("prefill-0", "prefill-1")]
        return min(sent) > 0 and worker_metric(server.url, BYTES, "decode-0") == sum(sent)

    wait_for(settled, 10, interval=0.2, message="decode-0's received bytes = the bytes sent")


BYTES = "splitserve:kv_transfer_bytes_total"


def queried(url: str, before: dict[tuple[str, str], float]) -> float:
    """Prompt tokens the prefill workers' stats have looked up since ``before``."""
    return sum(d["queries"] for d in delta(before, counters(url)).values())


def test_turn_2_on_the_other_replica_pulls_turn_1_prefix_from_it_over_the_transport(
    server: ServerProcess, smollm2_llm: LLM, smollm2_tokenizer: Any
) -> None:
    """Round robin sends consecutive requests to alternate prefill workers, so turn 2 runs on
    the replica that lacks the prefix; the router names turn 1's replica as its peer."""
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    params = SamplingParams(temperature=0.0, max_tokens=8)

    def turn(messages: list[Any]) -> tuple[str, dict]:
        before = counters(server.url)
        response = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        indexed_by = time.monotonic() + INDEX_PUBLISH_S
        prompt_tokens = len(prompt_ids(smollm2_tokenizer, messages))
        wait_for(
            lambda: queried(server.url, before) >= prompt_tokens,
            10,
            message=f"the prefill workers' stats counting the turn's {prompt_tokens} tokens",
        )
        expected = smollm2_llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        assert response.choices[0].message.content == expected
        # Nothing outside the API server shows its in-memory index: wait out the publish.
        time.sleep(max(0.0, indexed_by - time.monotonic()))
        return expected, delta(before, counters(server.url))

    turn1 = [
        {"role": "system", "content": system_prompt("harbours", 12)},
        {"role": "user", "content": "Name a ship."},
    ]
    answer, d1 = turn(turn1)
    holder = chosen(d1)
    turn2 = [*turn1, {"role": "assistant", "content": answer}]
    turn2.append({"role": "user", "content": "And a port?"})
    _, d2 = turn(turn2)
    puller = chosen(d2)
    ids1, ids2 = prompt_ids(smollm2_tokenizer, turn1), prompt_ids(smollm2_tokenizer, turn2)
    cached = reused(ids1, ids2)
    assert puller != holder
    assert cached >= 160
    assert d2[puller]["remote"] == cached
    assert d2[puller]["computed"] == len(ids2) - cached
