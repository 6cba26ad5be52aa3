"""One prefill worker + one decode worker (the default config) over gloo, against colocated."""

from __future__ import annotations

import asyncio
from functools import partial

import openai
import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams
from tests.support.disagg import MAX_TOKENS, MODEL, PROMPTS, Reference, completions, kv_bytes
from tests.support.server_process import ServerProcess, worker_metric
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    """The default deployment, shared with the other modules that only send it requests."""
    return default_server


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_30_prompts_greedy_equal_colocated_token_for_token(
    server: ServerProcess, prompts_reference: list[Reference], stream: bool
) -> None:
    assert completions(server.url, PROMPTS, stream) == prompts_reference


def test_32_concurrent_chat_streams_equal_colocated(
    server: ServerProcess, smollm2_llm: LLM
) -> None:
    chats = [
        [{"role": "user", "content": f"Give me a word that rhymes with {w}."}] for w in range(32)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = [o.outputs[0].text for o in smollm2_llm.chat(chats, params, use_tqdm=False)]
    client = openai.AsyncOpenAI(base_url=server.api, api_key="unused", max_retries=0)

    async def one(messages: list[dict[str, str]]) -> str:
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run_all() -> list[str]:
        return list(await asyncio.gather(*(one(m) for m in chats)))

    assert asyncio.run(run_all()) == expected


@pytest.mark.parametrize("num_tokens", [1, 16, 37])
def test_kv_bytes_of_one_request_are_layers_x_2_x_block_tokens_x_heads_x_dim_x_dtype(
    server: ServerProcess, smollm2_llm: LLM, num_tokens: int
) -> None:
    before = {w: worker_metric(server.url, BYTES, w) for w in ("prefill-0", "decode-0")}
    client = openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)
    prompt = [1000 + i for i in range(num_tokens)]
    client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    expected = kv_bytes(smollm2_llm, num_tokens)
    assert expected % (30 * 2 * 16 * 3 * 64 * 4) == 0  # SmolLM2: 30 layers, 3 kv heads, fp32
    for worker, start in before.items():
        wait_for(
            partial(bytes_reported, server.url, worker, start),
            10,
            message=f"{worker}'s stats counting the request's KV bytes",
        )
        assert worker_metric(server.url, BYTES, worker) - start == expected


BYTES = "splitserve:kv_transfer_bytes_total"


def bytes_reported(url: str, worker: str, start: float) -> bool:
    """The worker's KV bytes on /metrics have moved from ``start``."""
    return worker_metric(url, BYTES, worker) != start
