"""Request validation in-process: the request models and error handlers of the API server on
a bare FastAPI app, so each bad body's exact OpenAI error is checked without workers."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from starlette.requests import ClientDisconnect

from splitserve.services.api.errors import BodyLimitMiddleware, install_error_handlers
from splitserve.services.api.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.api.request_group import RequestGroup
from splitserve.services.api.serving import GroupStream

CHAT = [{"role": "user", "content": "hi"}]
HEADERS = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=32768, max_header_bytes=1024, timeout_s=30)

    @app.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return body.model_dump(exclude_unset=True)

    @app.post("/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return {"num_prompts": body.num_prompts}

    with TestClient(app) as test_client:
        yield test_client


def error(param: str | None, message: str, code: str | None = "invalid_value") -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": code,
        }
    }


OUT_OF_RANGE = [
    ("seed", 2**64, "seed: Input should be less than or equal to 9223372036854775807"),
    ("seed", -(2**63) - 1, "seed: Input should be greater than or equal to -9223372036854775808"),
    ("top_k", 2**64, "top_k: Input should be less than or equal to 2147483647"),
    ("top_k", -2, "top_k: Input should be greater than or equal to -1"),
    ("max_tokens", 2**63, "max_tokens: Input should be less than or equal to 2147483647"),
    ("min_tokens", 2**40, "min_tokens: Input should be less than or equal to 2147483647"),
    ("n", 2**64, "n: Input should be less than or equal to 2147483647"),
    ("stop", ["x"] * 17, "stop: at most 16 stop sequences"),
    ("stop", "x" * 1025, "stop: a stop sequence has at most 1024 characters"),
]


@pytest.mark.parametrize(("field", "value", "message"), OUT_OF_RANGE)
def test_a_value_the_engine_cannot_carry_is_400_naming_the_field(
    client: TestClient, field: str, value: Any, message: str
) -> None:
    response = client.post("/chat", json={"model": "m", "messages": CHAT, field: value})
    assert (response.status_code, response.json()) == (400, error(field, message))


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("field", ["temperature", "top_p", "repetition_penalty", "min_p"])
def test_a_float_that_is_not_finite_is_400(client: TestClient, field: str, literal: str) -> None:
    body = (
        f'{{"model": "m", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {literal}}}'
    )
    response = client.post("/chat", content=body, headers=HEADERS)
    message = f"{field}: Input should be a finite number"
    assert (response.status_code, response.json()) == (400, error(field, message))


def test_the_largest_values_that_fit_are_accepted(client: TestClient) -> None:
    body = {
        "model": "m",
        "messages": CHAT,
        "seed": 2**63 - 1,
        "top_k": -1,
        "stop": ["x" * 1024] * 16,
    }
    response = client.post("/chat", json=body)
    assert response.status_code == 200
    assert response.json()["seed"] == 2**63 - 1


UNSUPPORTED = [
    ("logit_bias", {"50256": -100}),
    ("guided_json", {"type": "object"}),
    ("functions", [{"name": "f"}]),
    ("parallel_tool_calls", False),
]


@pytest.mark.parametrize(("field", "value"), UNSUPPORTED, ids=[f for f, _ in UNSUPPORTED])
def test_an_unsupported_field_is_400_naming_it_not_invalid_json(
    client: TestClient, field: str, value: Any
) -> None:
    response = client.post("/chat", json={"model": "m", "messages": CHAT, field: value})
    message = f"{field} is not supported by this server"
    assert response.json() == error(field, message, "unsupported_parameter")
    assert response.status_code == 400


def test_unsupported_fields_set_to_ask_for_nothing_and_unknown_fields_are_accepted(
    client: TestClient,
) -> None:
    body = {
        "model": "m",
        "messages": CHAT,
        "tools": [],
        "tool_choice": "none",
        "response_format": {"type": "text"},
        "store": False,
    }
    assert client.post("/chat", json=body).status_code == 200


@pytest.mark.parametrize(
    ("field", "value"),
    [("tools", [{"type": "function", "function": {"name": "f"}}]), ("tool_choice", "auto")],
)
def test_tools_on_completions_are_400_unsupported(
    client: TestClient, field: str, value: Any
) -> None:
    response = client.post("/completions", json={"model": "m", "prompt": "a", field: value})
    message = f"{field} is not supported by this server"
    assert response.json() == error(field, message, "unsupported_parameter")


FN = {"type": "function", "function": {"name": "f"}}
BAD_SHAPES = [
    (
        {"response_format": {"type": "json_schema"}},
        "response_format",
        "response_format: json_schema is required with type json_schema, and only then",
    ),
    (
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
        "response_format.json_schema.name",
        "response_format.json_schema.name: Field required",
    ),
    (
        {"structured_outputs": {"regex": "a", "structural_tag": "x"}},
        "structured_outputs.structural_tag",
        "structured_outputs.structural_tag: Extra inputs are not permitted",
    ),
    (
        {"structured_outputs": {}},
        "structured_outputs",
        "structured_outputs needs exactly one of json, regex, choice, grammar, json_object",
    ),
    (
        {"structured_outputs": {"choice": ["a", ""]}},
        "structured_outputs",
        "structured_outputs.choice must be a non-empty list of non-empty strings",
    ),
    (
        {"tools": [FN, FN]},
        "tools",
        "tools: two tools have the same function name",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "tools.0.function.name",
        "tools.0.function.name: String should match pattern '^[a-zA-Z0-9_-]{1,64}$'",
    ),
    (
        {"tools": [FN], "tool_choice": "required", "structured_outputs": {"regex": "a"}},
        "tool_choice",
        "tool_choice required or a function cannot be combined with response_format or "
        "structured_outputs",
    ),
    (
        {"tool_choice": {"type": "function", "function": {"name": "f"}}},
        "tool_choice",
        "tool_choice required or a function needs tools",
    ),
    (
        {"messages": [{"role": "assistant", "content": None}]},
        "messages.0",
        "messages.0: content is required (null only for assistant tool_calls)",
    ),
    (
        {"messages": [{"role": "tool", "content": "18 degrees"}]},
        "messages.0",
        "messages.0: a tool message needs the tool_call_id it answers",
    ),
    (
        {
            "messages": [
                {
                    "role": "user",
                    "content": "x",
                    "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}"}}],
                }
            ]
        },
        "messages.0",
        "messages.0: only assistant messages have tool_calls",
    ),
]


@pytest.mark.parametrize(("change", "param", "message"), BAD_SHAPES)
def test_a_malformed_structured_output_or_tool_field_is_400_naming_it(
    client: TestClient, change: dict[str, Any], param: str, message: str
) -> None:
    response = client.post("/chat", json={"model": "m", "messages": CHAT, **change})
    assert (response.status_code, response.json()) == (400, error(param, message))


def test_tool_calls_and_results_become_chat_template_messages() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    body = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "2", "tool_call_id": "call_1"},
            ],
        }
    )
    assert [m.template_message() for m in body.messages] == [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "f", "arguments": {"a": 1}},
                }
            ],
        },
        {"role": "tool", "content": "2", "tool_call_id": "call_1"},
    ]


def test_a_model_level_check_names_its_field(client: TestClient) -> None:
    response = client.post("/chat", json={"model": "m", "messages": CHAT, "top_logprobs": 2})
    message = "top_logprobs requires logprobs to be true"
    assert (response.status_code, response.json()) == (400, error("top_logprobs", message))


def test_only_unparsable_json_is_invalid_json(client: TestClient) -> None:
    broken = client.post("/chat", content=b'{"model": "m", "messages": [', headers=HEADERS)
    assert broken.json() == error(None, "the request body is not valid JSON", "invalid_json")
    for body in (b"[1]", b'"text"', b""):
        response = client.post("/chat", content=body, headers=HEADERS)
        assert response.json() == error(None, "the request body must be a JSON object")


@pytest.mark.parametrize(
    ("prompt", "count"), [("a", 1), ([1, 2, 3], 1), (["a", "b"], 2), ([[1], [2], [3]], 3)]
)
def test_completions_count_the_prompts_of_each_form(
    client: TestClient, prompt: Any, count: int
) -> None:
    response = client.post("/completions", json={"model": "m", "prompt": prompt})
    assert response.json() == {"num_prompts": count}


def test_a_chunked_body_over_the_limit_is_400_body_too_large(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        yield b'{"model": "m", "messages": [{"role": "user", "content": "'
        yield from [b"x" * 10000] * 5
        yield b'"}]}'

    response = client.post("/chat", content=chunks(), headers=HEADERS)
    assert response.request.headers["Transfer-Encoding"] == "chunked"
    message = "the request body is larger than the limit of 32768 bytes"
    assert (response.status_code, response.json()) == (400, error(None, message, "body_too_large"))


def test_headers_over_the_limit_are_431(client: TestClient) -> None:
    response = client.post("/chat", json={}, headers={"X-Padding": "x" * 1024})
    message = "the request headers are larger than the limit of 1024 bytes"
    assert response.json() == error(None, message, "headers_too_large")
    assert response.status_code == 431


def test_a_stream_closes_its_group_when_the_client_left_before_the_first_byte() -> None:
    """The generator never starts, so only the response can release the admission."""
    aborted: list[str] = []
    group = RequestGroup(["r-0", "r-1"], aborted.extend)

    async def events() -> AsyncIterator[str]:
        try:
            yield "data: never\n\n"
        finally:
            group.close()

    async def gone(message: Any) -> None:
        raise OSError("connection reset")

    async def nothing() -> Any:
        return {"type": "http.disconnect"}

    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(ClientDisconnect):
        asyncio.run(GroupStream(group, events())(scope, nothing, gone))
    assert aborted == ["r-0", "r-1"]
