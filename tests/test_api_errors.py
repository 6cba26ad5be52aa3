"""Bad input gets its status and OpenAI error body from a real server, which keeps serving."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.support.keyed_deployment import KEY, MAX_MODEL_LEN, MAX_QUEUE, MODEL, OTHER_KEY
from tests.support.server_process import ServerProcess, metric
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
KEYS = (KEY, OTHER_KEY)
CHAT = [{"role": "user", "content": "Say hi."}]


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    """The keyed deployment (tests/support/keyed_deployment.py: two API keys, at most 2
    engine requests at once, n up to 4, bodies up to 16 KiB), shared with
    test_api_responses_messages."""
    return keyed_server


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=KEYS[1], max_retries=0)


def assert_still_serving(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert out.choices[0].finish_reason in ("stop", "length")


def error_of(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert isinstance(body["error"]["message"], str) and body["error"]["message"]
    return dict(body["error"])


CHAT_CASES = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 5}, "n"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"max_tokens": 5000}, "max_tokens"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
]


@pytest.mark.parametrize(("change", "param"), CHAT_CASES, ids=[p for _, p in CHAT_CASES])
def test_invalid_chat_value_is_400_naming_the_param(
    client: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "messages": CHAT, "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**body)
    error = error_of(info.value)
    assert info.value.status_code == 400
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert_still_serving(client)


def test_seeds_past_64_bits_are_400_and_leave_no_admission_behind(client: openai.OpenAI) -> None:
    """Before: each one got a 500 after it was admitted and held its slot for ever, so that
    past max_queue (MAX_QUEUE here) every request got 503 queue_full."""
    for _ in range(5):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=2,
                seed=2**64,  # type: ignore[arg-type]
            )
        assert error_of(info.value)["param"] == "seed"
    assert_still_serving(client)


def test_an_unsupported_field_is_400_naming_it(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=CHAT,  # type: ignore[arg-type]
            max_tokens=2,
            logit_bias={"50256": -100},
        )
    assert error_of(info.value) == {
        "message": "logit_bias is not supported by this server",
        "type": "invalid_request_error",
        "param": "logit_bias",
        "code": "unsupported_parameter",
    }
    assert_still_serving(client)


def test_more_choices_than_the_admission_bound_is_400_not_queue_full(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2, n=3)  # type: ignore[arg-type]
    assert error_of(info.value)["message"] == (
        f"n: 1 prompt(s) x n=3 make 3 engine requests, more than the {MAX_QUEUE} this server "
        "admits at once"
    )
    assert_still_serving(client)


# A 1x1 PNG: a valid image, which this text-only model cannot take.
PIXEL = (
    "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8"
    "z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)


def test_image_for_a_text_only_model_is_400_images_not_supported(client: openai.OpenAI) -> None:
    content = [
        {"type": "text", "text": "What is this?"},
        {"type": "image_url", "image_url": {"url": PIXEL}},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": content}],  # type: ignore[misc,list-item]
            max_tokens=4,
        )
    error = error_of(info.value)
    assert error["code"] == "images_not_supported" and error["param"] == "messages"
    assert "does not accept images" in error["message"]
    assert_still_serving(client)


def test_prompt_plus_max_tokens_over_context_is_context_length_exceeded(
    client: openai.OpenAI,
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="word " * 100, max_tokens=2000)
    error = error_of(info.value)
    assert error["code"] == "context_length_exceeded"
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in error["message"]
    assert_still_serving(client)


@pytest.mark.parametrize(
    ("change", "param"),
    [({"prompt": ""}, "prompt"), ({"prompt": [10**7]}, "prompt"), ({"logprobs": 21}, "logprobs")],
)
def test_invalid_completion_value_is_400(
    client: openai.OpenAI, change: dict[str, Any], param: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "prompt": "Hi", "max_tokens": 4, **change}
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**body)
    assert error_of(info.value)["param"] == param
    assert_still_serving(client)


def test_unknown_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-9", messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert error_of(info.value) == {
        "message": "The model `gpt-9` does not exist.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    assert_still_serving(client)


def test_malformed_json_and_oversized_bodies_and_headers_are_refused(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    headers = {"Authorization": f"Bearer {KEYS[0]}", "Content-Type": "application/json"}
    url = f"{server.api}/chat/completions"
    broken = httpx.post(url, content=b'{"model": "x", "messages": [', headers=headers)
    assert broken.status_code == 400
    assert broken.json()["error"]["code"] == "invalid_json"
    huge = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 20000}]}
    too_big = httpx.post(url, content=json.dumps(huge), headers=headers)
    assert too_big.status_code == 400
    assert too_big.json()["error"]["code"] == "body_too_large"
    chunked = httpx.post(url, content=iter([json.dumps(huge).encode()]), headers=headers)
    assert chunked.request.headers["Transfer-Encoding"] == "chunked"
    assert (chunked.status_code, chunked.json()["error"]["code"]) == (400, "body_too_large")
    padded = httpx.post(url, content=b"{}", headers={**headers, "X-Padding": "x" * 10000})
    assert (padded.status_code, padded.json()["error"]["code"]) == (431, "headers_too_large")
    assert_still_serving(client)


def test_missing_or_wrong_api_key_is_401(server: ServerProcess, client: openai.OpenAI) -> None:
    for key in ("wrong-key", KEYS[0][:-1]):
        bad = openai.OpenAI(base_url=server.api, api_key=key, max_retries=0)
        with pytest.raises(openai.AuthenticationError) as info:
            bad.models.list()
        assert error_of(info.value)["code"] == "invalid_api_key"
    missing = httpx.get(f"{server.api}/models")
    assert missing.status_code == 401 and missing.headers["WWW-Authenticate"] == "Bearer"
    assert httpx.get(f"{server.url}/health").status_code == 200
    other = openai.OpenAI(base_url=server.api, api_key=KEYS[0], max_retries=0)
    assert [m.id for m in other.models.list().data] == [MODEL]
    assert_still_serving(client)


def test_full_admission_queue_is_503_with_retry_after(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    headers = {"Authorization": f"Bearer {KEYS[0]}"}
    long = {
        "model": MODEL,
        "prompt": "Once",
        "max_tokens": MAX_MODEL_LEN - 16,
        "ignore_eos": True,
        "stream": True,
    }
    lines: list[Iterator[str]] = []
    with contextlib.ExitStack() as stack, httpx.Client(timeout=30, headers=headers) as http:
        for _ in range(MAX_QUEUE):
            stream = stack.enter_context(
                http.stream("POST", f"{server.api}/completions", json=long)
            )
            assert stream.status_code == 200
            lines.append(stream.iter_lines())  # dropping the iterator would close the stream
            next(lines[-1])
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert info.value.status_code == 503
        assert info.value.response.headers["Retry-After"] == "1"
        assert error_of(info.value)["code"] == "queue_full"
    wait_for(
        lambda: metric(server.url, "splitserve:num_requests_admitted") == 0,
        20,
        message="the two closed streams no longer admitted",
    )
    assert_still_serving(client)
