"""Hostile bytes in-process (issue 48): a lone surrogate anywhere in a body and nesting past the
bound are 400s naming the field, each refused request one bounded log line; a stream that
fails on the way ends with an error event and [DONE]; a request the engine ended for its
constraint's cost is an error naming it. tests/test_api_hostile_served.py sends the same
bodies to a real server."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fastapi import APIRouter, FastAPI
from fastapi.testclient import TestClient

from splitserve.services import messages as msg
from splitserve.services.api.errors import MAX_LOGGED_CHARS, install_error_handlers
from splitserve.services.api.json_body import MAX_DEPTH, CheckedRoute
from splitserve.services.api.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.services.api.request_group import EngineRequestError, RequestGroup
from splitserve.services.api.serving import ended

CHAT = [{"role": "user", "content": "hi"}]
HEADERS = {"Content-Type": "application/json"}
LONE = "\ud800"


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = FastAPI()
    install_error_handlers(app)
    router = APIRouter(route_class=CheckedRoute)

    @router.post("/chat")
    async def chat(body: ChatCompletionRequest) -> dict[str, Any]:
        return {"model": body.model}

    @router.post("/completions")
    async def completions(body: CompletionRequest) -> dict[str, Any]:
        return {"num_prompts": body.num_prompts}

    app.include_router(router)
    with TestClient(app) as test_client:
        yield test_client


def post(client: TestClient, path: str, body: Any) -> Any:
    """The body as JSON text with its surrogates escaped (``\\ud800``), as a client sends it."""
    return client.post(path, content=json.dumps(body), headers=HEADERS)


def ours(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The log records of splitserve (not of the test client)."""
    return [r for r in caplog.records if r.name.startswith("splitserve")]


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


def tool(parameters: dict[str, Any], description: str = "d") -> list[dict[str, Any]]:
    return [
        {
            "type": "function",
            "function": {"name": "f", "description": description, "parameters": parameters},
        }
    ]


SURROGATES: list[tuple[str, dict[str, Any], str]] = [
    ("/chat", {"messages": [{"role": "user", "content": LONE}]}, "messages.0.content"),
    (
        "/chat",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a" + LONE}]}]},
        "messages.0.content.0.text",
    ),
    ("/completions", {"prompt": LONE}, "prompt"),
    ("/completions", {"prompt": ["ok", "x\udfff"]}, "prompt.1"),
    ("/chat", {"messages": CHAT, "model": LONE}, "model"),
    ("/chat", {"messages": CHAT, "stop": [LONE]}, "stop.0"),
    (
        "/chat",
        {"messages": CHAT, "structured_outputs": {"choice": [LONE]}},
        "structured_outputs.choice.0",
    ),
    (
        "/completions",
        {"prompt": "a", "structured_outputs": {"regex": LONE}},
        "structured_outputs.regex",
    ),
    (
        "/completions",
        {"prompt": "a", "structured_outputs": {"grammar": f'root ::= "{LONE}"'}},
        "structured_outputs.grammar",
    ),
    ("/chat", {"messages": CHAT, "tools": tool({}, LONE)}, "tools.0.function.description"),
    (
        "/chat",
        {"messages": CHAT, "tools": tool({"type": "object", "properties": {LONE: {}}})},
        "tools.0.function.parameters.properties",
    ),
]


@pytest.mark.parametrize(("path", "body", "param"), SURROGATES)
def test_a_lone_surrogate_anywhere_is_400_naming_the_field(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    response = post(client, path, {"model": "m", **body})
    assert response.status_code == 400
    assert response.json() == {
        "error": {
            "message": f"{param}: a string holds a lone UTF-16 surrogate (such as \\ud800), "
            "which is not valid Unicode",
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_unicode",
        }
    }


def test_a_surrogate_pair_is_one_character_and_accepted(client: TestClient) -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "\U0001f600"}]}
    text = json.dumps(body)
    assert "\\ud83d\\ude00" in text
    assert client.post("/chat", content=text, headers=HEADERS).json() == {"model": "m"}


@pytest.mark.parametrize("depth", [MAX_DEPTH, 500, 970, 5000])
def test_deep_nesting_in_a_tool_schema_is_400_without_recursion(
    client: TestClient, depth: int, caplog: pytest.LogCaptureFixture
) -> None:
    body = {"model": "m", "messages": CHAT, "tools": tool(nested(depth // 2))}
    text = json.dumps(body) if depth < 900 else _deep_text(depth)
    with caplog.at_level(logging.INFO):
        response = client.post("/chat", content=text, headers=HEADERS)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "nesting_too_deep"
    assert error["message"].endswith(f"nested deeper than {MAX_DEPTH} levels")
    lines = ours(caplog)
    assert len(lines) == 1 and lines[0].name == "splitserve.requests"
    assert lines[0].exc_info is None and len(lines[0].getMessage()) < MAX_LOGGED_CHARS + 200


def _deep_text(depth: int) -> str:
    """A chat body whose tool parameters nest ``depth`` levels, written out as text (Python's
    encoder stops near 1,000 levels)."""
    inner = '{"type": "object", "properties": {"x": ' * (depth // 2)
    inner += '{"type": "object"}' + "}}" * (depth // 2)
    return json.dumps({"model": "m", "messages": CHAT, "tools": tool({})}).replace(
        '"parameters": {}', f'"parameters": {inner}'
    )


def test_each_refused_request_logs_one_bounded_line(
    client: TestClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        for path, body, _ in SURROGATES:
            post(client, path, {"model": "m", **body})
        post(client, "/chat", {"model": "m", "messages": CHAT, "temperature": "x" * 50_000})
    lines = ours(caplog)
    assert len(lines) == len(SURROGATES) + 1
    assert all(r.name == "splitserve.requests" for r in lines)
    assert all(r.exc_info is None for r in lines)
    first = json.loads(lines[0].getMessage())["refused"]
    assert first == {
        "path": "/chat",
        "status": 400,
        "code": "invalid_unicode",
        "message": "messages.0.content: a string holds a lone UTF-16 surrogate (such as "
        "\\ud800), which is not valid Unicode",
    }
    assert max(len(r.getMessage()) for r in lines) < MAX_LOGGED_CHARS + 200


async def _collect(stream: AsyncIterator[bytes]) -> list[str]:
    return [event.decode() async for event in stream]


def test_a_stream_that_fails_midway_ends_with_an_error_event_and_done(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def events() -> AsyncIterator[str]:
        yield "data: 1\n\n"
        yield f"data: {json.dumps({'x': LONE}, ensure_ascii=False)}\n\n"  # does not encode

    error = {
        "error": {
            "message": "internal server error",
            "type": "server_error",
            "param": None,
            "code": None,
        }
    }
    with caplog.at_level(logging.INFO):
        got = asyncio.run(_collect(ended(events())))
    assert got == ["data: 1\n\n", f"data: {json.dumps(error)}\n\n", "data: [DONE]\n\n"]
    assert len(ours(caplog)) == 1 and ours(caplog)[0].exc_info is None


def test_a_request_the_engine_ended_for_its_constraints_cost_is_an_error_naming_it() -> None:
    group = RequestGroup(["r-0"], lambda ids: None)
    why = "the structured output constraint took more than its compute budget of 10 s"
    delta = msg.TokenDelta("r-0", "ab", [1, 2], None, "error", why, 3, 0)

    async def read() -> None:
        group.queue.put_nowait((0, delta))
        async for _ in group:
            pass

    with pytest.raises(EngineRequestError) as raised:
        asyncio.run(read())
    assert (str(raised.value), raised.value.status) == (why, 400)
