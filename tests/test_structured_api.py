"""Structured outputs and tool calls through the OpenAI API of real servers (a colocated one
started here, and the shared 1 prefill + 1 decode deployment), against the offline engine."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.request import CompletionOutput
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from tests.support.server_process import ServerProcess, metric, serve

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
COMPILE_BOUND_S = 1
ASK_JSON = [{"role": "user", "content": "Give me an example as JSON."}]
SCHEMAS: dict[str, dict[str, Any]] = {
    "required_and_bounded_integer": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "email": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "age"],
    },
    "array_of_objects_pattern_and_enum": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                },
            },
            "status": {"enum": ["new", "paid", "shipped"]},
        },
        "required": ["id", "items", "status"],
    },
    "numbers_with_bounds": {
        "type": "object",
        "properties": {
            "x": {"type": "number", "minimum": -10, "maximum": 10},
            "y": {"type": "number", "exclusiveMinimum": 0, "maximum": 5},
            "label": {"type": "string", "enum": ["A", "B"]},
        },
        "required": ["x", "y", "label"],
    },
    "nested_object": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 10},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}},
                },
                "required": ["first", "tags"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
CITIES = ["Paris", "London", "Berlin"]
ARITHMETIC = """root ::= expr
expr ::= term (("+" | "-") term){0,3}
term ::= factor (("*" | "/") factor){0,2}
factor ::= [1-9] [0-9]{0,2} | "(" expr ")"
"""
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add", "parameters": ADD}},
]
SCHEMA_OF = {"get_weather": WEATHER, "add": ADD}
ASK_TOOL = [{"role": "user", "content": "What is the weather in Paris?"}]


GRAMMAR_BUDGET_S = 1
COSTLY = "root ::= (a | a a | a a a)*\na ::= [a-z]* | [a-z]+ [a-z]*"
"""Issue 48: every token's mask costs more than the last (tests/test_grammar_budget.py)."""


@pytest.fixture(scope="module")
def colocated() -> Iterator[ServerProcess]:
    with serve(
        f"server.grammar_timeout_s={COMPILE_BOUND_S}",
        f"pools.colocated.engine.grammar_budget_s={GRAMMAR_BUDGET_S}",
        config="configs/colocated.yaml",
    ) as s:
        yield s


@pytest.fixture(scope="module", params=["colocated", "1p1d"])
def client(request: pytest.FixtureRequest) -> openai.OpenAI:
    server = request.getfixturevalue(
        "colocated" if request.param == "colocated" else "default_server"
    )
    return openai.OpenAI(base_url=server.api, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def colocated_client(colocated: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=colocated.api, api_key="unused", max_retries=0)


def greedy(max_tokens: int, **constraint: Any) -> SamplingParams:
    spec = StructuredOutputsParams(**constraint) if constraint else None
    return SamplingParams(
        temperature=0.0, max_tokens=max_tokens, logprobs=0, structured_outputs=spec
    )


def token_texts(llm: LLM, out: CompletionOutput) -> list[str]:
    assert out.logprobs is not None
    return [
        str(lp[t].decoded_token or llm.engine.tokenizer.decode([t]))
        for lp, t in zip(out.logprobs, out.token_ids, strict=True)
    ]


def template_ids(llm: LLM, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
    ids = llm.engine.tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


def chat(client: openai.OpenAI, messages: Any, max_tokens: int, **kwargs: Any) -> Any:
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, **kwargs
    )


def streamed_chat(client: openai.OpenAI, messages: Any, max_tokens: int, **kwargs: Any) -> Any:
    """(content, [(name, arguments)], finish_reason) of a streamed chat, deltas merged."""
    content, calls, finish = "", [], None
    for chunk in chat(client, messages, max_tokens, stream=True, **kwargs):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index == len(calls) and call.type == "function"
                assert call.id.startswith("call_") and call.function.name
                calls.append([call.function.name, ""])
            calls[call.index][1] += call.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    return content, [tuple(c) for c in calls], finish


class Offline:
    """The offline engine's greedy outputs, each computed once for both servers."""

    def __init__(self, llm: LLM) -> None:
        self.llm = llm
        self.done: dict[str, CompletionOutput] = {}

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams) -> CompletionOutput:
        key = json.dumps(messages) + repr(params)
        if key not in self.done:
            self.done[key] = self.llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
        return self.done[key]

    def generate(self, prompt: str | list[int], params: SamplingParams) -> CompletionOutput:
        key = json.dumps(prompt) + repr(params)
        if key not in self.done:
            self.done[key] = self.llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        return self.done[key]


@pytest.fixture(scope="module")
def offline(smollm2_llm: LLM) -> Offline:
    return Offline(smollm2_llm)


def assert_token_for_token(choice: Any, llm: LLM, out: CompletionOutput) -> None:
    assert [t.token for t in choice.logprobs.content] == token_texts(llm, out)


@pytest.fixture(scope="module")
def offline_json(smollm2_llm: LLM) -> dict[str, CompletionOutput]:
    return {
        name: smollm2_llm.chat(ASK_JSON, greedy(80, json=schema), use_tqdm=False)[0].outputs[0]
        for name, schema in SCHEMAS.items()
    }


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_json_schema_outputs_validate_and_equal_offline_chat_token_for_token(
    client: openai.OpenAI, smollm2_llm: LLM, offline_json: dict[str, CompletionOutput], name: str
) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name]},
    }
    out = chat(client, ASK_JSON, 80, response_format=response_format, logprobs=True, top_logprobs=0)
    choice = out.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMAS[name])
    assert choice.message.content == offline_json[name].text
    assert choice.finish_reason == "stop"
    assert_token_for_token(choice, smollm2_llm, offline_json[name])


def test_streamed_constrained_text_equals_non_streamed(
    client: openai.OpenAI, offline_json: dict[str, CompletionOutput]
) -> None:
    name = "array_of_objects_pattern_and_enum"
    body = {"structured_outputs": {"json": SCHEMAS[name]}}
    content, calls, finish = streamed_chat(client, ASK_JSON, 80, extra_body=body)
    assert (content, calls, finish) == (offline_json[name].text, [], "stop")
    stream = client.completions.create(
        model=MODEL,
        prompt="Today's date:",
        max_tokens=12,
        temperature=0,
        stream=True,
        extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}-\d{2}"}},
    )
    text = "".join(c.choices[0].text for c in stream if c.choices)
    full = client.completions.create(
        model=MODEL,
        prompt="Today's date:",
        max_tokens=12,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r" \d{4}-\d{2}-\d{2}"}},
    )
    assert text == full.choices[0].text
    assert re.fullmatch(r" \d{4}-\d{2}-\d{2}", text)


def test_regex_choice_grammar_and_json_object_outputs_match_and_equal_offline(
    client: openai.OpenAI, smollm2_llm: LLM, offline: Offline
) -> None:
    cases: list[tuple[str, dict[str, Any], Any]] = [
        ("Give me a US phone number.", {"regex": PHONE}, lambda t: re.fullmatch(PHONE, t)),
        ("What is the capital of France?", {"choice": CITIES}, lambda t: t in CITIES),
        (
            "What is 12 plus 7 times 3? Write it as an expression.",
            {"grammar": ARITHMETIC},
            lambda t: is_arithmetic(ast.parse(t, mode="eval").body),
        ),
        (
            "Write a JSON object with a name and an age.",
            {"json_object": True},
            lambda t: isinstance(json.loads(t), dict),
        ),
    ]
    for ask, constraint, matches in cases:
        messages = [{"role": "user", "content": ask}]
        expected = offline.chat(messages, greedy(40, **constraint))
        out = chat(client, messages, 40, extra_body={"structured_outputs": constraint})
        text = out.choices[0].message.content
        assert matches(text), (constraint, text)
        assert (text, out.choices[0].finish_reason) == (expected.text, "stop")
    prompt = "Today's date:"
    date = {"regex": r" \d{4}-\d{2}-\d{2}"}
    expected = offline.generate(prompt, greedy(12, **date))
    full = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logprobs=0,
        extra_body={"structured_outputs": date},
    )
    assert full.choices[0].text == expected.text
    assert full.choices[0].logprobs is not None
    assert full.choices[0].logprobs.tokens == token_texts(smollm2_llm, expected)


def is_arithmetic(node: ast.AST) -> bool:
    if isinstance(node, ast.BinOp):
        ops = (ast.Add, ast.Sub, ast.Mult, ast.Div)
        return isinstance(node.op, ops) and is_arithmetic(node.left) and is_arithmetic(node.right)
    return isinstance(node, ast.Constant) and isinstance(node.value, int)


def calls_of(message: Any) -> list[tuple[str, str]]:
    assert message.content is None
    for call in message.tool_calls:
        assert call.type == "function" and re.fullmatch(r"call_[0-9a-f]{24}", call.id)
    return [(c.function.name, c.function.arguments) for c in message.tool_calls]


def test_named_tool_choice_yields_arguments_of_its_schema_equal_offline(
    client: openai.OpenAI, smollm2_llm: LLM, offline: Offline
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = chat(client, ASK_TOOL, 40, tools=TOOLS, tool_choice=named)
    [(name, arguments)] = calls_of(out.choices[0].message)
    assert name == "get_weather"
    jsonschema.validate(json.loads(arguments), WEATHER)
    assert out.choices[0].finish_reason == "tool_calls"
    prompt = template_ids(smollm2_llm, ASK_TOOL, TOOLS)
    assert arguments == offline.generate(prompt, greedy(40, json=WEATHER)).text
    assert streamed_chat(client, ASK_TOOL, 40, tools=TOOLS, tool_choice=named) == (
        "",
        [(name, arguments)],
        "tool_calls",
    )


def test_required_tool_choice_yields_calls_of_the_tools_equal_offline(
    client: openai.OpenAI, smollm2_llm: LLM, offline: Offline
) -> None:
    asks = [ASK_TOOL, [{"role": "user", "content": "Add 2 and 3, then tell me Rome's weather."}]]
    calls_schema = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "arguments": t["function"]["parameters"],
                    },
                    "required": ["name", "arguments"],
                }
                for t in TOOLS
            ]
        },
    }
    for messages, stream in zip(asks, (False, True), strict=True):
        out = chat(client, messages, 64, tools=TOOLS, tool_choice="required")
        calls = calls_of(out.choices[0].message)
        assert calls and out.choices[0].finish_reason == "tool_calls"
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMA_OF[name])
        prompt = template_ids(smollm2_llm, messages, TOOLS)
        params = greedy(64, json=calls_schema)
        expected = json.loads(offline.generate(prompt, params).text)
        assert [(n, json.loads(a)) for n, a in calls] == [
            (c["name"], c["arguments"]) for c in expected
        ]
        if stream:
            streamed = streamed_chat(client, messages, 64, tools=TOOLS, tool_choice="required")
            assert streamed == ("", calls, "tool_calls")


HERMES = [
    {
        "role": "system",
        "content": "You are a function calling AI. You call functions by writing "
        '<tool_call>{"name": <function-name>, "arguments": <args-dict>}</tool_call>.',
    },
    {
        "role": "user",
        "content": "Copy this line exactly, nothing else:\n"
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    },
]


def test_auto_tool_choice_reads_hermes_tool_call_blocks_streamed_and_not(
    client: openai.OpenAI, smollm2_llm: LLM, offline: Offline
) -> None:
    tools = TOOLS[:1]
    prompt = template_ids(smollm2_llm, HERMES, tools)
    expected = offline.generate(prompt, greedy(32))
    block, close, rest = expected.text.partition("</tool_call>")
    assert close and block.startswith("<tool_call>")  # the model wrote one call, then text
    out = chat(client, HERMES, 32, tools=tools)
    message = out.choices[0].message
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    assert message.content == rest
    assert out.choices[0].finish_reason == expected.finish_reason
    arguments = message.tool_calls[0].function.arguments
    assert streamed_chat(client, HERMES, 32, tools=tools) == (
        rest,
        [("get_weather", arguments)],
        expected.finish_reason,
    )
    plain = chat(client, HERMES, 32, tools=tools, tool_choice="none").choices[0]
    assert (plain.message.content, plain.message.tool_calls) == (expected.text, None)


def test_tool_calls_and_results_go_back_through_the_chat_template(
    colocated_client: openai.OpenAI, smollm2_llm: LLM
) -> None:
    arguments = '{"city": "Paris", "unit": "celsius"}'
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather"}}
    messages = [
        *ASK_TOOL,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{**call, "function": {**call["function"], "arguments": arguments}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    rendered = [
        *ASK_TOOL,
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {**call, "function": {**call["function"], "arguments": json.loads(arguments)}}
            ],
        },
        {"role": "tool", "content": "18 degrees and sunny", "tool_call_id": "call_1"},
    ]
    prompt = template_ids(smollm2_llm, rendered, TOOLS)
    expected = smollm2_llm.generate(prompt, greedy(12), use_tqdm=False)[0]
    out = chat(colocated_client, messages, 12, tools=TOOLS)
    assert out.usage.prompt_tokens == len(prompt)
    assert out.choices[0].message.content == expected.outputs[0].text


SLOW_REGEX = "(" + "|".join(f"[a-z]{{{i}}}x" for i in range(1, 120)) + ")"
"""Compiles in about 3.5 s against SmolLM2's vocabulary on the 2-core VM: over the bound."""
NESTED: dict[str, Any] = {"type": "object"}
for _ in range(400):
    NESTED = {"type": "object", "properties": {"a": NESTED}}
FN = {"type": "function", "function": {"name": "f"}}
BAD = [
    (
        "invalid_schema",
        {"structured_outputs": {"json": {"type": "nope"}}},
        "structured_outputs",
        "invalid JSON schema: 'nope' is not valid",
    ),
    (
        "schema_not_json",
        {"structured_outputs": {"json": "{oops"}},
        "structured_outputs",
        "the JSON schema is not valid JSON",
    ),
    (
        "unsupported_keyword",
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object", "not": {}}},
            }
        },
        "response_format",
        "unsupported JSON schema keyword 'not' at #",
    ),
    (
        "invalid_regex",
        {"structured_outputs": {"regex": "(ab"}},
        "structured_outputs",
        "invalid regex: ",
    ),
    (
        "grammar_syntax",
        {"structured_outputs": {"grammar": 'root ::= "a" |'}},
        "structured_outputs",
        "invalid grammar: EBNF parser error",
    ),
    (
        "over_size_bound",
        {"structured_outputs": {"regex": "a" * 70000}},
        "structured_outputs",
        "the regex is 70000 bytes, over the limit of 65536",
    ),
    (
        "over_time_bound",
        {"structured_outputs": {"regex": SLOW_REGEX}},
        "structured_outputs",
        f"the regex took longer than {COMPILE_BOUND_S} s to compile",
    ),
    (  # refused with the body, before the constraint's check (json_body.MAX_DEPTH)
        "nested_too_deeply",
        {"structured_outputs": {"json": NESTED}},
        "structured_outputs.json" + ".properties.a" * 31,
        "nested deeper than 64 levels",
    ),
    (
        "two_kinds",
        {"structured_outputs": {"regex": "a", "choice": ["a"]}},
        "structured_outputs",
        "exactly one of",
    ),
    (
        "two_fields",
        {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
        "structured_outputs",
        "not both",
    ),
    (
        "tool_without_name",
        {"tools": [{"type": "function", "function": {}}]},
        "tools.0.function.name",
        "Field required",
    ),
    (
        "tool_parameters_not_object",
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}
            ]
        },
        "tools.0.function.parameters",
        '"type": "object"',
    ),
    (
        "tool_parameters_invalid",
        {
            "tools": [
                FN,
                {
                    "type": "function",
                    "function": {"name": "g", "parameters": {"properties": {"a": {"type": 3}}}},
                },
            ]
        },
        "tools.1.function.parameters",
        "invalid JSON schema",
    ),
    (
        "unknown_function",
        {"tools": [FN], "tool_choice": {"type": "function", "function": {"name": "g"}}},
        "tool_choice",
        "no tool is the function 'g'",
    ),
    ("required_without_tools", {"tool_choice": "required"}, "tool_choice", "needs tools"),
]


def routed_requests(server: ServerProcess) -> float:
    try:
        return metric(server.url, "splitserve:router_decisions_total")
    except KeyError:  # none routed yet
        return 0.0


@pytest.mark.parametrize(
    ("change", "param", "reason"), [b[1:] for b in BAD], ids=[b[0] for b in BAD]
)
def test_a_bad_constraint_or_tool_is_400_with_its_reason_and_the_next_request_succeeds(
    colocated: ServerProcess, change: dict[str, Any], param: str, reason: str
) -> None:
    routed = routed_requests(colocated)
    body = {"model": MODEL, "messages": ASK_JSON, "max_tokens": 3, **change}
    response = httpx.post(f"{colocated.api}/chat/completions", json=body, timeout=60)
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["type"], error["param"]) == ("invalid_request_error", param)
    assert reason in error["message"]
    assert routed_requests(colocated) == routed  # no worker saw it
    good = {
        "model": MODEL,
        "messages": ASK_JSON,
        "max_tokens": 3,
        "structured_outputs": {"choice": ["yes", "no"]},
    }
    response = httpx.post(f"{colocated.api}/chat/completions", json=good, timeout=60)
    assert response.status_code == 200
    assert response.json()["choices"][0]["message"]["content"] in ("yes", "no")


@pytest.mark.parametrize("stream", [False, True], ids=["full", "streamed"])
def test_a_grammar_past_its_compute_budget_is_an_error_naming_it(
    colocated: ServerProcess, stream: bool
) -> None:
    body = {
        "model": MODEL,
        "prompt": "Write letters:",
        "max_tokens": 100,
        "min_tokens": 100,
        "temperature": 0,
        "structured_outputs": {"grammar": COSTLY},
        "stream": stream,
    }
    response = httpx.post(f"{colocated.api}/completions", json=body, timeout=120)
    if stream:
        events = [line[6:] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
    else:
        assert response.status_code == 400
        error = response.json()["error"]
    assert error["code"] == "invalid_value"
    assert error["message"].startswith(
        f"the structured output constraint took more than its compute budget of "
        f"{GRAMMAR_BUDGET_S} s (CPU time computing which tokens it allows) after "
    )
