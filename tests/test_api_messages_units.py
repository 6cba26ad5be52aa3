"""Responses and Messages in-process (issue 46): what each body becomes as a chat
conversation, keys in x-api-key beside Bearer, each API's error shape (refusals and a stream
that fails on the way)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from fastapi import FastAPI
from fastapi.testclient import TestClient

from splitserve.server_config import ServerConfig
from splitserve.services.api import messages_api, responses
from splitserve.services.api.errors import install_error_handlers
from splitserve.services.api.messages_protocol import MessagesRequest
from splitserve.services.api.request_group import EngineRequestError
from splitserve.services.api.responses_protocol import ResponsesRequest
from splitserve.services.api.serving import ended

KEY = "k-1"
USER = {"role": "user", "content": "hi"}
ARGS = '{"city": "Paris"}'


def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(responses.router)
    app.include_router(messages_api.router)
    app.state.server = SimpleNamespace(config=SimpleNamespace(server=ServerConfig(api_keys=(KEY,))))
    return TestClient(app)


def test_keys_in_x_api_key_or_bearer_and_each_apis_error_shape() -> None:
    test = client()
    message = {"model": "m", "messages": [USER]}
    refused = test.post("/v1/messages", json=message)
    assert refused.status_code == 401
    assert refused.json() == {
        "type": "error",
        "error": {"type": "authentication_error", "message": "invalid or missing API key"},
    }
    for headers in ({"x-api-key": KEY}, {"Authorization": f"Bearer {KEY}"}):
        answer = test.post("/v1/messages", json=message, headers=headers)
        assert answer.status_code == 400
        assert answer.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "max_tokens: Field required"},
        }
    assert test.post("/v1/responses", json={"input": "hi"}).json()["error"] == {
        "message": "invalid or missing API key",
        "type": "authentication_error",
        "param": None,
        "code": "invalid_api_key",
    }
    stateful = {"model": "m", "input": "hi", "previous_response_id": "resp_1"}
    answer = test.post("/v1/responses", json=stateful, headers={"x-api-key": KEY})
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "previous_response_id"


def test_a_failing_stream_ends_with_each_apis_error_event() -> None:
    async def failing() -> AsyncIterator[str]:
        yield "event: message_start\ndata: {}\n\n"
        raise EngineRequestError("the KV transfer timed out", 503)

    async def read(style: Any) -> list[bytes]:
        return [chunk async for chunk in ended(failing(), style)]

    events = asyncio.run(read(messages_api.MESSAGES_STREAM))
    assert events[1:] == [
        b'event: error\ndata: {"type": "error", "error": {"type": "overloaded_error", '
        b'"message": "the KV transfer timed out"}}\n\n',
        b"",
    ]
    events = asyncio.run(read(responses.RESPONSES_STREAM))
    assert events[1] == (
        b'event: error\ndata: {"type": "error", "code": "request_failed", '
        b'"message": "the KV transfer timed out", "param": null}\n\n'
    )


def test_messages_blocks_become_chat_messages() -> None:
    body = MessagesRequest.model_validate(
        {
            "model": "m",
            "max_tokens": 8,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Let me look."},
                        {"type": "tool_use", "id": "t1", "name": "w", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "t1", "content": "Sunny"},
                        {"type": "text", "text": "And tomorrow?"},
                    ],
                },
            ],
            "tool_choice": {"type": "any"},
            "tools": [{"name": "w", "input_schema": {"type": "object"}}],
            "thinking": {"type": "disabled"},
            "stop_sequences": ["\n\n"],
        }
    )
    chat = body.chat_body()
    call = {"id": "t1", "type": "function", "function": {"name": "w", "arguments": ARGS}}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        USER,
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "Let me look."}],
            "tool_calls": [call],
        },
        {"role": "tool", "tool_call_id": "t1", "content": "Sunny"},
        {"role": "user", "content": [{"type": "text", "text": "And tomorrow?"}]},
    ]
    assert chat["tool_choice"] == "required" and chat["stop"] == ["\n\n"]
    assert chat["chat_template_kwargs"] == {"enable_thinking": False}


def test_responses_items_become_chat_messages() -> None:
    body = ResponsesRequest.model_validate(
        {
            "model": "m",
            "instructions": "Be brief.",
            "input": [
                {"role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {"type": "reasoning", "id": "rs_1", "summary": []},
                {"type": "function_call", "call_id": "c1", "name": "w", "arguments": ARGS},
                {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
            ],
            "tool_choice": {"type": "function", "name": "w"},
            "tools": [{"type": "function", "name": "w"}],
            "text": {"format": {"type": "json_schema", "name": "x", "schema": {}}},
            "reasoning": {"effort": "none"},
            "seed": 3,
        }
    )
    chat = body.chat_body()
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": ARGS}}
    assert chat["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "Sunny"},
    ]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "w"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {}, "description": None},
    }
    assert chat["chat_template_kwargs"] == {"enable_thinking": False} and chat["seed"] == 3
