"""Tool calls read out of generated text (services/api/tool_calls.py), and the constraint of
tool_choice required (services/api/tools.py): exact events, whole text or one character at a
time."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from splitserve.services.api.errors import APIError
from splitserve.services.api.tool_calls import (
    Event,
    ListParser,
    NamedParser,
    OutputParser,
    ToolCallDelta,
    message,
    stream_delta,
)
from splitserve.services.api.tool_formats import HermesParser
from splitserve.services.api.tools import ToolDefinition, calls_schema, plan

NAMES = frozenset({"f", "g"})


def hermes() -> HermesParser:
    return HermesParser(NAMES)


CALLS = (
    '[{"name": "get_weather", "arguments": {"city": "Pa\\"ris}", "n": [1, {"a": 2}]}}, '
    '{"name": "add", "arguments": {}}]'
)


def without_ids(events: list[Event]) -> list[Any]:
    return [
        e if isinstance(e, str) else (e.index, e.name, e.arguments, e.id is not None)
        for e in events
    ]


def per_character(parser: OutputParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    """What a client streamed one character per delta puts together."""
    events: list[Event] = []
    for c in text:
        events += parser.feed(c)
    events += parser.finish()
    content = "".join(e for e in events if isinstance(e, str))
    calls: list[list[str]] = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                calls.append([str(e.name), ""])
            calls[e.index][1] += e.arguments
    return (content or None) if calls else content, [(n, a) for n, a in calls]


def merged(parser: OutputParser, text: str) -> tuple[str | None, list[tuple[str, str]]]:
    content, calls = message(parser, text)
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function"
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


def test_required_list_reports_each_name_then_its_arguments_as_written() -> None:
    events = ListParser().feed(CALLS)
    assert without_ids(events) == [
        (0, "get_weather", "", True),
        (0, None, '{"city": "Pa\\"ris}", "n": [1, {"a": 2}]}', False),
        (1, "add", "", True),
        (1, None, "{}", False),
    ]


def test_required_list_truncated_keeps_the_arguments_so_far() -> None:
    assert merged(ListParser(), CALLS[:44]) == (None, [("get_weather", '{"city')])


@pytest.mark.parametrize(
    ("factory", "text", "expected"),
    [
        (
            ListParser,
            CALLS,
            (None, [("get_weather", json.loads(CALLS)[0]["arguments"]), ("add", {})]),
        ),
        (lambda: NamedParser("f"), '{"x": [1]}', (None, [("f", {"x": [1]})])),
        (lambda: NamedParser("f"), "", (None, [("f", "")])),
        (
            hermes,
            'Sure.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {"b": "é"}}</tool_call>\n',
            ("Sure.", [("f", {"a": 1}), ("g", {"b": "é"})]),
        ),
        (
            hermes,
            '<tool_call>{"name": "f"}</tool_call>\n\nmore text ',
            ("\n\nmore text", [("f", {})]),
        ),
        (hermes, "a < b <tool_ca", ("a < b <tool_ca", [])),
        (
            hermes,
            'x <tool_call>{bad}</tool_call> y <tool_call>{"name"',
            ('x <tool_call>{bad}</tool_call> y <tool_call>{"name"', []),
        ),
        (
            hermes,
            '<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>',
            ('<tool_call>{"name": "f", "arguments": "not an object"}</tool_call>', []),
        ),
        (hermes, "  plain text\n", ("  plain text\n", [])),
        (
            hermes,
            'x <tool_call>{"name": "rm", "arguments": {}}</tool_call>',
            ('x <tool_call>{"name": "rm", "arguments": {}}</tool_call>', []),
        ),
        (
            hermes,
            '<tool_call>{"name": ["f"], "arguments": {}}</tool_call>',
            ('<tool_call>{"name": ["f"], "arguments": {}}</tool_call>', []),
        ),
        (OutputParser, "<tool_call>{}</tool_call>", ("<tool_call>{}</tool_call>", [])),
    ],
    ids=[
        "required",
        "named",
        "named_empty",
        "hermes_two_calls",
        "hermes_call_then_text",
        "hermes_partial_tag",
        "hermes_bad_blocks",
        "hermes_arguments_not_object",
        "hermes_no_calls",
        "hermes_tool_not_offered",
        "hermes_name_not_a_string",
        "no_tools",
    ],
)
def test_streamed_one_character_at_a_time_equals_the_whole_text(
    factory: Callable[[], OutputParser], text: str, expected: Any
) -> None:
    whole, streamed = merged(factory(), text), per_character(factory(), text)
    assert whole == streamed
    content, calls = whole
    decoded = [(n, a if isinstance(a, str) and not a else json.loads(a)) for n, a in calls]
    assert (content, decoded) == expected


@pytest.mark.parametrize(
    ("text", "streamed"),
    [
        (
            'x <tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>',
            ('x"}}</tool_call>', [("f", '{"a": "\\ud800')]),
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"\\udfff": 1}}</tool_call>',
            ('f": 1}}</tool_call>', [("f", '{"\\udff')]),
        ),
        (
            '<tool_call>{"name": "f", "arguments": {"a": [1, 2}}</tool_call>',
            ("}}</tool_call>", [("f", '{"a": [1, 2')]),
        ),
        (
            '<tool_call>{"name": "g", "arguments": {"a": "cut short',
            (None, [("g", '{"a": "cut short')]),
        ),
    ],
    ids=["surrogate_in_a_value", "surrogate_in_a_key", "bad_json", "unfinished"],
)
def test_a_call_that_breaks_after_it_was_streamed_keeps_what_was_sent(
    text: str, streamed: Any
) -> None:
    """Streamed, a call goes out once its name and the start of its arguments are read; a
    break after that (a lone surrogate, JSON that does not parse, the output ending) cannot
    take it back: the call keeps the arguments sent, the rest is content and the finish
    reason is not tool_calls. Read whole, the block is content as written."""
    assert merged(hermes(), text) == (text, [])
    parser = hermes()
    assert per_character(parser, text) == streamed
    assert parser.finish_reason("stop") == "stop"


def test_finish_reason_is_tool_calls_only_for_calls_that_completed() -> None:
    parser = ListParser()
    parser.feed(CALLS)
    assert [parser.finish_reason(r) for r in ("stop", "length")] == ["tool_calls", "length"]
    assert hermes().finish_reason("stop") == "stop"


def test_a_streamed_call_starts_with_id_type_and_name_then_only_arguments() -> None:
    first = stream_delta(ToolCallDelta(1, "", "call_x", "f"))
    assert first == {
        "tool_calls": [
            {
                "index": 1,
                "id": "call_x",
                "type": "function",
                "function": {"name": "f", "arguments": ""},
            }
        ]
    }
    assert stream_delta(ToolCallDelta(1, '{"a"')) == {
        "tool_calls": [{"index": 1, "function": {"arguments": '{"a"'}}]
    }


def tools(*parameters: dict[str, Any] | None) -> tuple[ToolDefinition, ...]:
    return tuple(
        ToolDefinition.model_validate(
            {"type": "function", "function": {"name": f"t{i}", "parameters": p}}
        )
        for i, p in enumerate(parameters)
    )


def test_required_schema_is_a_list_of_name_and_arguments_with_definitions_at_the_root() -> None:
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    with_defs = {
        "type": "object",
        "properties": {"p": {"$ref": "#/$defs/point"}},
        "$defs": {"point": point},
    }
    assert calls_schema(tools(with_defs, None)) == {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": ["t0"]},
                        "arguments": {
                            "type": "object",
                            "properties": {"p": {"$ref": "#/$defs/point"}},
                        },
                    },
                    "required": ["name", "arguments"],
                },
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": ["t1"]},
                        "arguments": {"type": "object", "properties": {}},
                    },
                    "required": ["name", "arguments"],
                },
            ]
        },
        "$defs": {"point": point},
    }


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        (
            [{"type": "object", "properties": {"self": {"$ref": "#"}}}],
            "tools.0.function.parameters: tool_choice required cannot combine a schema with "
            "the $ref '#' (only #/$defs/... and #/definitions/...)",
        ),
        (
            [{"$defs": {"a": {"type": "integer"}}}, {"$defs": {"a": {"type": "string"}}}],
            "tools.1.function.parameters: $defs/a is defined differently by another tool",
        ),
    ],
)
def test_required_schema_refuses_references_it_cannot_keep(
    parameters: list[dict[str, Any]], reason: str
) -> None:
    with pytest.raises(APIError) as info:
        calls_schema(tools(*parameters))
    assert (info.value.status, info.value.message) == (400, reason)


def test_tool_choice_defaults_to_auto_with_tools_and_none_without() -> None:
    assert plan(list(tools(None)), None).mode == "auto"
    assert plan(None, None).mode == "none"
    assert plan(None, "auto").mode == "none"
    assert plan(list(tools(None)), "none").constraint() is None
