"""tool_choice auto calls as they stream (services/api/marked_calls.py, tool_formats.py): the
exact events of each feed, in every format; the grammar against Python's JSON parser; special
marks kept by the detokenizer. Real model output is read in test_output_formats.py."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.services.api.call_grammar import Broken, value
from splitserve.services.api.json_body import surrogate_free
from splitserve.services.api.output import special_marks
from splitserve.services.api.tool_calls import Event, merge
from splitserve.services.api.tool_formats import PARSERS, MistralParser

NAMES = frozenset({"get_weather", "get_time"})
CALL = ("call", "get_weather")


def fed(name: str, chunks: list[str]) -> list[list[Any]]:
    """Each feed's events, then finish's: text as is, a call's first delta as (index, "call",
    name, arguments) (its id checked), later ones as (index, arguments)."""
    parser = PARSERS[name](NAMES)
    steps = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    assert parser.finish_reason("stop") == "tool_calls"
    return [[_shown(e) for e in events] for events in steps]


def _shown(event: Event) -> Any:
    if isinstance(event, str):
        return event
    if event.id is None:
        return (event.index, event.arguments)
    assert event.id.startswith("call_") and len(event.id) == 29
    return (event.index, "call", event.name, event.arguments)


def test_hermes_streams_text_then_each_call_as_it_is_written() -> None:
    chunks = [
        "Let me check.",
        " <tool",
        '_call>\n{"name": "get_weather", "argu',
        'ments": {"city',
        '": "Paris"',
        "}}\n</tool_call>\n<tool_call>",
        '{"arguments": {"tz": 1}, "name": "get_time"}',
        "</tool_call>",
    ]
    assert fed("hermes", chunks) == [
        ["Let me check."],
        [],
        [],
        [(0, "call", "get_weather", ""), (0, '{"city')],
        [(0, '": "Paris"')],
        [(0, "}")],
        [(1, "call", "get_time", ""), (1, '{"tz": 1}')],
        [],
        [],
    ]


def test_deepseek_streams_the_fenced_arguments() -> None:
    chunks = [
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_",
        'weather\n```json\n{"ci',
        'ty": "Rome"}',
        "\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{",
        "}<｜tool▁call▁end｜><｜tool▁calls▁",
        "end｜>",
    ]
    assert fed("deepseek_v3", chunks) == [
        [],
        [(0, "call", "get_weather", ""), (0, '{"ci')],
        [(0, 'ty": "Rome"}')],
        [(1, "call", "get_time", ""), (1, "{")],
        [(1, "}")],
        [],
        [],
    ]


def test_llama3_json_streams_each_call_of_the_output() -> None:
    chunks = [
        '<|python_tag|>{"name": "get_weather", "parameters": {"ci',
        'ty": "Rome"}}; {"name": "get_',
        'time", "parameters": {}}',
    ]
    assert fed("llama3_json", chunks) == [
        [(0, "call", "get_weather", ""), (0, '{"ci')],
        [(0, 'ty": "Rome"}')],
        [(1, "call", "get_time", ""), (1, "{}")],
        [],
    ]


def test_mistral_streams_a_list_and_the_newer_one_call_a_mark() -> None:
    listed = [
        "Sure. [TOOL_",
        'CALLS][{"name": "get_weather", "arguments": {"city": "Ro',
        'me"}}, {"name": "get_time", "arguments": {}}]',
    ]
    assert fed("mistral", listed) == [
        ["Sure."],
        [(0, "call", "get_weather", ""), (0, '{"city": "Ro')],
        [(0, 'me"}'), (1, "call", "get_time", ""), (1, "{}")],
        [],
    ]
    newer = ['[TOOL_CALLS]get_weather[ARGS]{"city": ', '"Rome"}[TOOL_CALLS]get_time[AR', "GS]{}"]
    assert fed("mistral", newer) == [
        [(0, "call", "get_weather", ""), (0, '{"city": ')],
        [(0, '"Rome"}')],
        [(1, "call", "get_time", ""), (1, "{}")],
        [],
    ]


def test_a_call_whose_name_comes_last_goes_out_with_its_arguments_so_far() -> None:
    chunks = ['<tool_call>{"arguments": {"city": "Rome"', '}, "name": "get_weather"}</tool_call>']
    assert fed("hermes", chunks) == [
        [],
        [(0, "call", "get_weather", ""), (0, '{"city": "Rome"}')],
        [],
    ]


def test_a_call_without_arguments_has_an_empty_object() -> None:
    assert fed("hermes", ['<tool_call>{"name": "get_time"', "}</tool_call>"]) == [
        [],
        [(0, "call", "get_time", "{}")],
        [],
    ]


def test_the_grammar_reads_objects_exactly_as_pythons_json_parser() -> None:
    """Mutations of JSON objects: the grammar ends exactly at the end of those that parse as
    an object with no lone surrogate, and breaks on the others."""
    seeds = [
        '{"a": [1, 2.5e3, "x\\"y", true, null, false, -0.5E+2, {"b": {}}]}',
        '{"s": "\\ud83d\\ude00 \\u00e9 \\\\"}',
        '{"k": [[], [{}], ""], "n": 0}',
    ]
    alphabet = [*'{}[]",:0123456789.-+eEtrufalsn \\u/ab\n\t', "\\ud800", "\\udc00", "\x01"]
    rng = random.Random(0)
    for _ in range(3000):
        text = rng.choice(seeds)
        for _ in range(rng.randint(1, 3)):
            at = rng.randrange(len(text) + 1)
            text = text[:at] + rng.choice(alphabet) + text[at + rng.randint(0, 1) :]
        if text.startswith("{"):
            assert _reads(text) == _parses(text), text


def _reads(text: str) -> bool:
    reader = value(None)
    next(reader)
    for at, c in enumerate(text):
        try:
            reader.send(c)
        except StopIteration:
            return at == len(text) - 1
        except Broken:
            return False
    return False


def _parses(text: str) -> bool:
    try:
        parsed = json.loads(text)
    except ValueError:
        return False
    return isinstance(parsed, dict) and text == text.rstrip() and surrogate_free(parsed)


def test_a_kept_special_mark_is_written_where_the_model_wrote_it(smollm2_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [MistralParser.open]})
    mark = tokenizer.convert_tokens_to_ids(MistralParser.open)
    assert special_marks(tokenizer, MistralParser.marks) == (mark,)  # [ARGS] is plain text
    assert special_marks(smollm2_tokenizer, MistralParser.marks) == ()
    text = 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {}}]'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert mark in ids[1:-1]
    unmarked = text.replace(MistralParser.open, "")
    for kept, written, read in (
        ({mark}, text, ("Sure.", [("get_weather", "{}")])),
        (set(), unmarked, (unmarked, [])),
    ):
        detokenizer = IncrementalDetokenizer(tokenizer, [], [], kept=frozenset(kept))
        deltas = []
        for token in ids:
            before = len(detokenizer.text)
            detokenizer.add(token, check_stop=False)
            deltas.append(detokenizer.text[before:])
        detokenizer.flush()
        assert "".join(deltas) == detokenizer.text == written
        parser = MistralParser(NAMES)
        content, calls = merge(
            [e for delta in deltas for e in parser.feed(delta)] + parser.finish()
        )
        assert (
            content,
            [(c["function"]["name"], c["function"]["arguments"]) for c in calls],
        ) == read
