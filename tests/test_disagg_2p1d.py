"""Two prefill workers + one decode worker, routed round robin, no disk tier: still colocated
outputs, both prefill workers used, and a chat's turn 2 on the other prefill worker pulls
turn 1's prefix from its peer over the KV transport."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from tests.support.disagg import MODEL, PROMPTS, completions, reference
from tests.support.prefix_counters import chosen, counters, delta, prompt_ids, reused, system_prompt
from tests.support.server_process import ServerProcess, serve, worker_metric

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with serve("pools.prefill.replicas=2", "router.policy=round_robin") as process:
        yield process


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_30_prompts_through_2_prefill_workers_equal_colocated(
    server: ServerProcess, smollm2_llm: LLM, stream: bool
) -> None:
    assert completions(server.url, PROMPTS, stream) == reference(smollm2_llm, PROMPTS)


def test_round_robin_sent_kv_from_both_prefill_workers(server: ServerProcess) -> None:
    completions(server.url, PROMPTS[:4], stream=False)
    sent = [worker_metric(server.url, BYTES, w) for w in ("prefill-0", "prefill-1")]
    assert min(sent) > 0
    assert worker_metric(server.url, BYTES, "decode-0") == sum(sent)


BYTES = "splitserve:kv_transfer_bytes_total"


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
        time.sleep(0.8)  # a stats report and an index publish
        expected = smollm2_llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
        assert response.choices[0].message.content == expected
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
