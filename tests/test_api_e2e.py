"""The OpenAI API of a real `splitserve serve` process, compared with the offline LLM."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import openai
import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.request import RequestOutput
from splitserve.engine.sampling_params import SamplingParams
from tests.support.server_process import ServerProcess, metric
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
CHATS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one?"},
    ],
]


@pytest.fixture(scope="module")
def server(default_server: ServerProcess) -> ServerProcess:
    """The default deployment, shared with the other modules that only send it requests."""
    return default_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


def greedy(max_tokens: int, **kwargs: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def reference_chat(llm: LLM, messages: list[dict[str, Any]], max_tokens: int) -> RequestOutput:
    return llm.chat(messages, greedy(max_tokens), use_tqdm=False)[0]


def test_chat_greedy_equals_llm_chat_streamed_and_not(
    client: openai.OpenAI, smollm2_llm: LLM
) -> None:
    for messages in CHATS:
        ref = reference_chat(smollm2_llm, messages, 12)
        full = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,  # type: ignore[arg-type]
        )
        assert full.choices[0].message.content == ref.outputs[0].text
        assert full.choices[0].finish_reason == ref.outputs[0].finish_reason
        assert full.usage is not None
        assert full.usage.prompt_tokens == len(ref.prompt_token_ids)
        assert full.usage.completion_tokens == len(ref.outputs[0].token_ids)
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,  # type: ignore[arg-type]
                max_completion_tokens=12,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == ref.outputs[0].text
        assert chunks[0].choices[0].delta.role == "assistant"
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert (
            finishes[-1] == ref.outputs[0].finish_reason
            and finishes.count(None) == len(finishes) - 1
        )
        assert chunks[-1].choices == [] and chunks[-1].usage == full.usage


def test_chat_content_as_text_parts_equals_string_content(client: openai.OpenAI) -> None:
    as_parts = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    as_string = [{"role": "user", "content": "Name a color."}]
    texts = [
        client.chat.completions.create(
            model=MODEL,
            messages=m,
            max_tokens=6,
            temperature=0,  # type: ignore[arg-type]
        )
        .choices[0]
        .message.content
        for m in (as_parts, as_string)
    ]
    assert texts[0] == texts[1]


def test_completions_greedy_equal_llm_generate(client: openai.OpenAI, smollm2_llm: LLM) -> None:
    prompts = ["The capital of France is", "One, two, three,"]
    refs = smollm2_llm.generate(prompts, greedy(10), use_tqdm=False)
    batch = client.completions.create(model=MODEL, prompt=prompts, max_tokens=10, temperature=0)
    assert [c.text for c in batch.choices] == [r.outputs[0].text for r in refs]
    assert [c.index for c in batch.choices] == [0, 1]
    assert batch.usage is not None
    assert batch.usage.prompt_tokens == sum(len(r.prompt_token_ids) for r in refs)
    assert batch.usage.completion_tokens == sum(len(r.outputs[0].token_ids) for r in refs)
    by_ids = client.completions.create(
        model=MODEL, prompt=refs[0].prompt_token_ids, max_tokens=10, temperature=0
    )
    assert by_ids.choices[0].text == refs[0].outputs[0].text
    echoed = client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=10, temperature=0, echo=True
    )
    assert echoed.choices[0].text == prompts[0] + refs[0].outputs[0].text
    streamed = client.completions.create(
        model=MODEL, prompt=prompts[1], max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == refs[1].outputs[0].text


def test_streamed_text_equals_non_streamed_with_multibyte_characters(
    client: openai.OpenAI, smollm2_llm: LLM
) -> None:
    prompt = "Emoji party: 🎉🎉"
    ref = smollm2_llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0]
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    stream = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True
    )
    pieces = [c.choices[0].text for c in stream]
    assert full.choices[0].text == ref.text == "".join(pieces)
    assert any(ord(ch) > 0xFFFF for ch in ref.text)
    assert full.choices[0].finish_reason == "length"


def test_stop_string_ends_with_finish_reason_stop(client: openai.OpenAI, smollm2_llm: LLM) -> None:
    prompt = "One, two, three,"
    ref = smollm2_llm.generate(prompt, greedy(12, stop=["five"]), use_tqdm=False)[0].outputs[0]
    out = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop="five"
    )
    assert out.choices[0].text == ref.text and "five" not in ref.text
    assert out.choices[0].finish_reason == ref.finish_reason == "stop"


def test_n_choices_with_seed_are_reproducible(client: openai.OpenAI) -> None:
    def ask() -> Any:
        return client.chat.completions.create(
            model=MODEL,
            messages=CHATS[0],
            max_tokens=8,
            n=3,
            seed=7,
            temperature=1.0,  # type: ignore[arg-type]
        )

    first, second = ask(), ask()
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.message.content for c in first.choices] == [c.message.content for c in second.choices]
    assert first.usage is not None and first.usage.completion_tokens <= 24


def test_chat_logprobs_report_top_alternatives(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=CHATS[0],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,  # type: ignore[arg-type]
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    assert "".join(entry.token for entry in content) == out.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0.0
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely


def test_32_concurrent_streams_each_get_their_text(server: ServerProcess, smollm2_llm: LLM) -> None:
    prompts = [f"Count from {i} to {i + 5}:" for i in range(32)]
    refs = [r.outputs[0].text for r in smollm2_llm.generate(prompts, greedy(6), use_tqdm=False)]

    async def one(client: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=6, temperature=0, stream=True
        )
        return "".join([c.choices[0].text async for c in stream])

    async def run_all() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.api, api_key="x", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    assert asyncio.run(run_all()) == refs


def free_blocks(server: ServerProcess) -> float:
    return metric(server.url, "splitserve:kv_cache_free_blocks")


def admitted(server: ServerProcess) -> float:
    return metric(server.url, "splitserve:num_requests_admitted")


def test_disconnect_mid_stream_frees_kv_blocks(server: ServerProcess) -> None:
    total = metric(server.url, "splitserve:kv_cache_total_blocks")
    body = {
        "model": MODEL,
        "prompt": "Write a very long story about a dragon.",
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{server.api}/completions", json=body) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()
        for _ in range(10):
            next(lines)
        wait_for(lambda: free_blocks(server) < total, 20, message="the stream's KV blocks in use")
    wait_for(lambda: free_blocks(server) == total, 20, message="every KV block free again")
    assert metric(server.url, "splitserve:num_requests_running") == 0
    assert metric(server.url, "splitserve:num_requests_admitted") == 0


def test_disconnect_during_non_streamed_request_aborts_it(server: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.api}/completions", json=body, timeout=2.0)
    wait_for(lambda: admitted(server) == 0, 20, message="the aborted request no longer admitted")
    total = metric(server.url, "splitserve:kv_cache_total_blocks")
    wait_for(lambda: free_blocks(server) == total, 20, message="every KV block free again")


def test_models_health_and_metrics(server: ServerProcess, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.url}/health").json() == {
        "status": "ok",
        "workers_ready": 2,
        "pools": {
            "prefill": {"status": "ok", "replicas": 1, "ready": 1},
            "decode": {"status": "ok", "replicas": 1, "ready": 1},
        },
    }
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_waiting", "kv_cache_usage_perc", "time_to_first_token_seconds"):
        assert f"splitserve:{name}" in text
    assert metric(server.url, "splitserve:generation_tokens_total") > 0
