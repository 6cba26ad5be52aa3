"""Hostile bytes sent to a real server (issue 48), with the official openai client and raw
httpx: lone surrogates and deep nesting are 400s with the API's error object and one log line
each, never a traceback; model output that reads as a malformed tool call (a surrogate, a tool
not offered) is plain text, whole and streamed (but for a call that went out before it broke:
services/api/marked_calls.py), and the stream ends with [DONE]."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.server_process import ServerProcess
from tests.support.wait import wait_for

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
CHAT = [{"role": "user", "content": "Call a tool."}]
SURROGATE = {
    "message": "messages.0.content: a string holds a lone UTF-16 surrogate (such as \\ud800), "
    "which is not valid Unicode",
    "type": "invalid_request_error",
    "param": "messages.0.content",
    "code": "invalid_unicode",
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get",
            "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
        },
    }
]


def refused_lines(server: ServerProcess) -> list[str]:
    return [line for line in server.lines if line.startswith('splitserve request {"refused"')]


def send(server: ServerProcess, path: str, content: bytes) -> httpx.Response:
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{server.api}/{path}", content=content, headers=headers, timeout=60)


def test_surrogates_and_deep_nesting_are_400s_logged_in_one_line_each(
    default_server: ServerProcess,
) -> None:
    client = openai.OpenAI(base_url=default_server.api, api_key="none", max_retries=0)
    before = len(refused_lines(default_server))
    raw = b'{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL.encode()
    assert (send(default_server, "chat/completions", raw).json()) == {"error": SURROGATE}
    prompt = b'{"model": "%s", "prompt": "a\\udc00b", "max_tokens": 2}' % MODEL.encode()
    answer = send(default_server, "completions", prompt)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "invalid_unicode")
    # A surrogate's bytes as raw UTF-8 (CESU-8): Python's JSON parser lets them through.
    cesu = b'{"model": "%s", "prompt": "\xed\xa0\x80"}' % MODEL.encode()
    answer = send(default_server, "completions", cesu)
    assert (answer.status_code, answer.json()["error"]["param"]) == (400, "prompt")
    assert answer.json()["error"]["code"] == "invalid_unicode"
    depth = 485  # 970 levels of objects
    schema = '{"type": "object", "properties": {"x": ' * depth + "{}" + "}}" * depth
    tools = json.dumps(TOOLS).replace(
        '{"type": "object", "properties": {"x": {"type": "string"}}}', schema
    )
    deep = b'{"model": "%s", "messages": [], "tools": %s}' % (MODEL.encode(), tools.encode())
    answer = send(default_server, "chat/completions", deep)
    assert (answer.status_code, answer.json()["error"]["code"]) == (400, "nesting_too_deep")
    wait_for(lambda: len(refused_lines(default_server)) == before + 4, 10, message="4 lines")
    new = refused_lines(default_server)[before:]
    assert max(len(line) for line in new) < 600
    assert not any("Traceback" in line for line in default_server.lines)
    out = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=2)  # type: ignore[arg-type]
    assert out.usage is not None and out.usage.completion_tokens == 2


MALFORMED = [
    '<tool_call>{"name": "get", "arguments": {"x": "\\ud800"}}</tool_call>',
    '<tool_call>{"name": "rm", "arguments": {"x": "/"}}</tool_call>',
]
STREAMED = [
    ('"}}</tool_call>', [("get", '{"x": "\\ud800')]),
    (MALFORMED[1], []),
]
"""What the stream puts together: the call of an offered tool went out as its arguments began
(it cannot be taken back when the surrogate breaks them: the rest is content); the tool not
offered is plain text."""


def forced(output: str, stream: bool) -> dict[str, Any]:
    """A chat body whose tools are offered (tool_choice auto) and whose output is ``output``."""
    return {
        "model": MODEL,
        "messages": CHAT,
        "tools": TOOLS,
        "structured_outputs": {"choice": [output]},
        "max_tokens": 64,
        "temperature": 0,
        "stream": stream,
    }


@pytest.mark.parametrize(
    ("output", "streamed_as"),
    list(zip(MALFORMED, STREAMED, strict=True)),
    ids=["surrogate", "tool_not_offered"],
)
def test_model_output_that_is_a_malformed_tool_call_is_plain_text(
    default_server: ServerProcess, output: str, streamed_as: Any
) -> None:
    client = openai.OpenAI(base_url=default_server.api, api_key="none", max_retries=0)
    body = forced(output, False)
    whole = client.chat.completions.create(
        model=MODEL,
        messages=CHAT,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        max_tokens=64,
        temperature=0,
        extra_body={"structured_outputs": body["structured_outputs"]},
    )
    choice = whole.choices[0]
    assert (choice.message.content, choice.message.tool_calls) == (output, None)
    assert choice.finish_reason == "stop"
    url = f"{default_server.api}/chat/completions"
    streamed = httpx.post(url, json=forced(output, True), timeout=120)
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(event) for event in events[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls: list[list[str]] = []
    for call in [call for d in deltas for call in d.get("tool_calls", [])]:
        if "id" in call:
            calls.append([call["function"]["name"], ""])
        calls[call["index"]][1] += call["function"]["arguments"]
    content = "".join(d.get("content") or "" for d in deltas)
    assert (content, [tuple(c) for c in calls]) == streamed_as
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
