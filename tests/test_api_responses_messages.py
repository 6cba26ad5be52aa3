"""POST /v1/responses and POST /v1/messages (issue 46) with the official openai and anthropic
clients against a 1P1D deployment on SmolLM2, started as `vllm serve` would be:
`splitserve serve smollm2-135m-instruct --port N --api-key K --served-model-name ...` (the
keyed deployment, tests/support/keyed_deployment.py; the anthropic client sends its key as
x-api-key). Each answer is compared with the chat completion of the same conversation
(greedy): the two APIs are that conversation in another shape, streamed or not."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import openai
import pytest

from tests.support.keyed_deployment import KEY, MAX_MODEL_LEN, MODEL
from tests.support.server_process import ServerProcess

AUTH = {"Authorization": f"Bearer {KEY}"}
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}
ASK = "What is the weather in Paris?"
ANSWER = [{"role": "user", "content": ASK}]
GREEDY = {"temperature": 0}
LONE = {"role": "user", "content": "\ud800"}
"""A lone surrogate: json.dumps writes it escaped, as a client sends it."""
THINK = r"<think>[a-z ]{4,20}</think>[A-Z][a-z ]{4,20}\."


@pytest.fixture(scope="module")
def server(keyed_server: ServerProcess) -> ServerProcess:
    """The keyed deployment, shared with test_api_errors (which adds a second API key and its
    small admission limits: one request at a time here)."""
    return keyed_server


@pytest.fixture(scope="module")
def oai(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.api, api_key=KEY, max_retries=0)


@pytest.fixture(scope="module")
def claude(server: ServerProcess) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def test_the_vllm_style_command_line_serves_the_model_by_its_name(
    server: ServerProcess, oai: openai.OpenAI
) -> None:
    [card] = oai.models.list().data
    assert (card.id, card.model_extra["max_model_len"]) == (MODEL, MAX_MODEL_LEN)
    assert httpx.get(f"{server.api}/models").status_code == 401
    answer = chat(oai, ANSWER, max_tokens=4)
    assert answer.model == MODEL and answer.usage.completion_tokens == 4


def chat(oai: openai.OpenAI, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
    return oai.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def test_responses_text_equals_chat_streamed_and_not(
    server: ServerProcess, oai: openai.OpenAI
) -> None:
    reference = chat(oai, ANSWER, max_tokens=12)
    text = reference.choices[0].message.content
    response = oai.responses.create(model=MODEL, input=ASK, max_output_tokens=12, **GREEDY)
    assert response.output_text == text and response.status == "incomplete"
    assert response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage is not None
    assert response.usage.input_tokens == reference.usage.prompt_tokens
    assert response.usage.output_tokens == 12
    stream = oai.responses.create(
        model=MODEL, input=ASK, max_output_tokens=12, stream=True, **GREEDY
    )
    seen = list(stream)
    kinds = [e.type for e in seen]
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(deltas) == text
    assert [e.sequence_number for e in seen] == list(range(len(seen)))
    final = seen[-1].response
    assert final.output_text == text and final.output[0].id == seen[2].item.id


def test_responses_function_tool_and_its_output_round_trip(oai: openai.OpenAI) -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER}
    response = oai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=40,
        **GREEDY,
    )
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments) == {"city": "Paris"} and response.status == "completed"
    stream = oai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[tool],
        tool_choice="required",
        max_output_tokens=40,
        stream=True,
        **GREEDY,
    )
    seen = list(stream)
    done = [e for e in seen if e.type == "response.function_call_arguments.done"]
    deltas = [e.delta for e in seen if e.type == "response.function_call_arguments.delta"]
    assert [e.arguments for e in done] == ["".join(deltas)] == [call.arguments]
    assert seen[-1].type == "response.completed"
    followed = [
        {"role": "user", "content": ASK},
        {
            "type": "function_call",
            "call_id": call.call_id,
            "name": call.name,
            "arguments": call.arguments,
        },
        {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"},
    ]
    answer = oai.responses.create(
        model=MODEL, input=followed, tools=[tool], max_output_tokens=16, **GREEDY
    )
    reference = chat(
        oai,
        [
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": "Sunny, 21 C"},
        ],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}],
        max_tokens=16,
    )
    assert answer.output_text == reference.choices[0].message.content


def test_responses_json_schema_output_follows_it(oai: openai.OpenAI) -> None:
    schema = {"type": "json_schema", "name": "weather", "schema": WEATHER, "strict": True}
    kwargs: dict[str, Any] = dict(
        model=MODEL, input=ASK, text={"format": schema}, max_output_tokens=30, **GREEDY
    )
    response = oai.responses.create(**kwargs)
    assert json.loads(response.output_text) in ({"city": "Paris"}, {"city": "Rome"})
    streamed = list(oai.responses.create(stream=True, **kwargs))
    assert streamed[-1].response.output_text == response.output_text


def test_messages_tool_round_trip_equals_chat(
    claude: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    tools: Any = [{"name": "get_weather", "description": "the weather", "input_schema": WEATHER}]
    first = claude.messages.create(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": ASK}],
        tools=tools,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    )
    [use] = first.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}
    assert first.stop_reason == "tool_use"
    with claude.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=[{"role": "user", "content": ASK}],
        tools=tools,
        tool_choice={"type": "any"},
        extra_body=GREEDY,
    ) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.name, b.input) for b in streamed.content] == [
        ("tool_use", use.name, use.input)
    ]
    turns: Any = [
        {"role": "user", "content": ASK},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
        },
        {
            "role": "user",
            "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}],
        },
    ]
    answer = claude.messages.create(
        model=MODEL,
        max_tokens=16,
        messages=turns,
        tools=tools,
        extra_body=GREEDY,
        system="Be brief.",
    )
    reference = chat(
        oai,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": ASK},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {"name": use.name, "arguments": json.dumps(use.input)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"},
        ],
        tools=[
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "the weather",
                    "parameters": WEATHER,
                },
            }
        ],
        max_tokens=16,
    )
    [text] = answer.content
    assert text.type == "text" and text.text == reference.choices[0].message.content
    counted = claude.messages.count_tokens(
        model=MODEL, messages=turns, tools=tools, system="Be brief."
    )
    assert counted.input_tokens == answer.usage.input_tokens == reference.usage.prompt_tokens
    assert answer.stop_reason == "max_tokens" and answer.usage.output_tokens == 16
    with claude.messages.stream(
        model=MODEL,
        max_tokens=16,
        messages=turns,
        tools=tools,
        extra_body=GREEDY,
        system="Be brief.",
    ) as stream:
        assert "".join(stream.text_stream) == text.text
        assert stream.get_final_message().stop_reason == "max_tokens"


CALL = (
    '<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "(Paris|Rome)"\\}\\}</tool_call>'
)
"""SmolLM2 held to a Hermes call (its template names no format: Hermes is read) with
tool_choice auto: the parser, not a grammar of the tools, finds the call."""


def test_auto_tool_calls_stream_as_written_in_every_api(
    oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    held = {"structured_outputs": {"regex": CALL}}
    function = {"name": "get_weather", "parameters": WEATHER}
    tools: Any = [{"type": "function", "function": function}]
    whole = chat(oai, ANSWER, max_tokens=60, tools=tools, extra_body=held).choices[0]
    [call] = whole.message.tool_calls
    arguments = call.function.arguments
    assert (call.function.name, arguments, whole.finish_reason) == (
        "get_weather",
        '{"city": "Paris"}',
        "tool_calls",
    )
    chunks = chat(oai, ANSWER, max_tokens=60, tools=tools, stream=True, extra_body=held)
    first, *rest = [
        part for c in chunks if c.choices for part in c.choices[0].delta.tool_calls or []
    ]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (
        0,
        "function",
        "get_weather",
        "",
    )
    assert first.id.startswith("call_") and all((p.index, p.id) == (0, None) for p in rest)
    fragments = [p.function.arguments for p in rest]
    assert "".join(fragments) == arguments and len(fragments) >= 5
    response = oai.responses.create(
        model=MODEL,
        input=ASK,
        tools=[{"type": "function", **function}],  # type: ignore[list-item]
        max_output_tokens=60,
        stream=True,
        extra_body=held,
        **GREEDY,
    )
    events = list(response)
    added = next(e for e in events if e.type == "response.output_item.added")
    assert (added.item.type, added.item.name) == ("function_call", "get_weather")
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert deltas == fragments and events[-1].response.output[0].arguments == arguments
    with claude.messages.stream(
        model=MODEL,
        max_tokens=60,
        messages=ANSWER,  # type: ignore[arg-type]
        tools=[{"name": "get_weather", "input_schema": WEATHER}],
        extra_body={**held, **GREEDY},
    ) as stream:
        sent = list(stream)
        final = stream.get_final_message()
    partial = [
        e.delta.partial_json
        for e in sent
        if e.type == "content_block_delta" and e.delta.type == "input_json_delta"
    ]
    assert partial == fragments and final.stop_reason == "tool_use"
    assert [(b.type, b.name, b.input) for b in final.content] == [
        ("tool_use", "get_weather", {"city": "Paris"})
    ]


def test_messages_stop_sequence_is_reported(
    claude: anthropic.Anthropic, oai: openai.OpenAI
) -> None:
    reference = chat(oai, ANSWER, max_tokens=12).choices[0].message.content
    stop = reference.split()[2]
    message = claude.messages.create(
        model=MODEL, max_tokens=12, messages=ANSWER, stop_sequences=[stop], extra_body=GREEDY
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == reference[: reference.index(stop)]


def test_reasoning_from_think_blocks_in_every_api(
    server: ServerProcess, oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    """SmolLM2 held to ``<think>...</think>Answer.`` by a regex: the per-request thinking
    switch reads the block as reasoning."""
    constrained = {"structured_outputs": {"regex": THINK}, **GREEDY}
    whole = (
        chat(oai, ANSWER, max_tokens=40, extra_body={"structured_outputs": {"regex": THINK}})
        .choices[0]
        .message.content
    )
    thought, answer = whole.removeprefix("<think>").split("</think>")
    switched = {"chat_template_kwargs": {"enable_thinking": True}, **constrained}
    message = chat(oai, ANSWER, max_tokens=40, extra_body=switched).choices[0].message
    assert (message.reasoning_content, message.content) == (thought, answer)
    deltas = list(chat(oai, ANSWER, max_tokens=40, stream=True, extra_body=switched))
    reasoning = [
        getattr(c.choices[0].delta, "reasoning_content", None) for c in deltas if c.choices
    ]
    content = [c.choices[0].delta.content for c in deltas if c.choices]
    assert "".join(r for r in reasoning if r) == thought
    assert "".join(c for c in content if c) == answer
    response = oai.responses.create(
        model=MODEL,
        input=ASK,
        reasoning={"effort": "low"},
        max_output_tokens=40,
        extra_body=constrained,
    )
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"] and response.output_text == answer
    assert response.output[0].content[0].text == thought
    with claude.messages.stream(
        model=MODEL,
        max_tokens=40,
        messages=ANSWER,
        thinking={"type": "enabled", "budget_tokens": 1024},
        extra_body=constrained,
    ) as stream:
        final = stream.get_final_message()
    assert [
        (b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in final.content
    ] == [("thinking", thought), ("text", answer)]


def test_errors_have_each_apis_shape(server: ServerProcess) -> None:
    no_max = {"model": MODEL, "messages": ANSWER}
    answer = httpx.post(f"{server.url}/v1/messages", json=no_max, headers={"x-api-key": KEY})
    assert answer.status_code == 400
    body = answer.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in body["error"]["message"]
    lone = httpx.post(
        f"{server.url}/v1/messages",
        content=json.dumps({"model": MODEL, "max_tokens": 4, "messages": [LONE]}),
        headers={"Content-Type": "application/json", **AUTH},
    )
    assert lone.status_code == 400 and lone.json()["error"]["type"] == "invalid_request_error"
    stateful = {"model": MODEL, "input": "hi", "previous_response_id": "resp_1"}
    answer = httpx.post(f"{server.url}/v1/responses", json=stateful, headers=AUTH)
    assert answer.status_code == 400
    assert answer.json()["error"]["param"] == "previous_response_id"
    assert answer.json()["error"]["code"] == "unsupported_parameter"
    web = {"model": MODEL, "input": "hi", "tools": [{"type": "web_search"}]}
    assert httpx.post(f"{server.url}/v1/responses", json=web, headers=AUTH).status_code == 400
    unknown = {"model": "claude-x", "max_tokens": 4, "messages": ANSWER}
    answer = httpx.post(f"{server.url}/v1/messages", json=unknown, headers=AUTH)
    assert (answer.status_code, answer.json()) == (
        404,
        {
            "type": "error",
            "error": {"type": "not_found_error", "message": "The model `claude-x` does not exist."},
        },
    )
    unkeyed = httpx.post(f"{server.url}/v1/messages", json=no_max)
    assert unkeyed.status_code == 401
    assert unkeyed.json()["error"]["type"] == "authentication_error"
