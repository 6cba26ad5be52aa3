"""Reasoning and the tool-call formats beside Hermes (issue 46), read from real model output:
SmolLM2 held by a regex to write each format, its tokens detokenized as a worker streams
them; every output read whole and token by token must give the same reasoning, content and
calls, and token by token each call must go out as it is written: its name as soon as its
arguments begin, then each token's part of the arguments. Malformed output is content, as
written. Mistral's ``[TOOL_CALLS]`` as a special token is written by a tiny model, and kept.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.detokenizer import IncrementalDetokenizer
from splitserve.engine.llm import LLM
from splitserve.engine.llm_engine import LLMEngine
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.server_config import ServerConfig
from splitserve.services.api.output import Blocks, ChoiceReader, OutputFormat
from splitserve.services.api.reasoning import Reasoning, ThinkSplitter, opened_in_prompt
from splitserve.services.api.tool_calls import OutputParser, ToolCallDelta
from splitserve.services.api.tool_formats import (
    PARSERS,
    DeepSeekParser,
    Llama3JsonParser,
    MistralParser,
    detect,
)
from splitserve.services.api.tools import ToolDefinition, plan
from tests.support.tiny_models import tiny_model

CITY = '\\{"city": "(Paris|Rome)"\\}'
FORMATS = {
    "deepseek_v3": (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        + CITY
        + "\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    ),
    "llama3_json": '\\{"name": "get_weather", "parameters": ' + CITY + "\\}",
    "mistral": '\\[TOOL_CALLS\\]\\[\\{"name": "get_weather", "arguments": ' + CITY + "\\}\\]",
    "hermes": '<tool_call>\\{"name": "get_weather", "arguments": ' + CITY + "\\}</tool_call>",
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMES = frozenset({"get_weather"})


def model_output(
    llm: LLM, regex: str, max_tokens: int = 160, kept: tuple[int, ...] = ()
) -> list[str]:
    """The greedy output under ``regex``, as the text deltas a worker sends (one a token);
    kept: special tokens kept in the text."""
    spec = StructuredOutputsParams(regex=regex)
    params = SamplingParams(
        temperature=0.0,
        max_tokens=max_tokens,
        structured_outputs=spec,
        kept_special_token_ids=list(kept),
    )
    [output] = llm.chat(ASK, params, use_tqdm=False)
    detok = IncrementalDetokenizer(llm.engine.tokenizer, [], [], kept=frozenset(kept))
    deltas = []
    for token in output.outputs[0].token_ids:
        before = len(detok.text)
        detok.add(token, check_stop=False)
        deltas.append(detok.text[before:])
    detok.flush()
    deltas[-1] += detok.text[len("".join(deltas)) :]
    assert "".join(deltas) == output.outputs[0].text
    return deltas


Read = tuple[str, str, list[tuple[str | None, str]]]
"""(reasoning, content, [(name, arguments as written)])."""


def read(reader: ChoiceReader | OutputParser, deltas: list[str]) -> Read:
    """What a client streamed ``deltas`` puts together."""
    events: list[Any] = []
    for delta in deltas:
        events += reader.feed(delta)
    return merged(events + reader.finish())


def read_whole(reader: ChoiceReader | OutputParser, text: str) -> Read:
    """The non-streamed answer."""
    return merged(reader.read(text) if isinstance(reader, ChoiceReader) else reader.whole(text))


def merged(events: list[Any]) -> Read:
    thought = "".join(e.text for e in events if isinstance(e, Reasoning))
    content = "".join(e for e in events if isinstance(e, str))
    calls: list[list[Any]] = []
    for e in events:
        if isinstance(e, ToolCallDelta):
            if e.id is not None:
                calls.append([e.name, ""])
            calls[e.index][1] += e.arguments
    return thought, content, [(name, arguments) for name, arguments in calls]


ARGUMENTS = '{"city": "Paris"}'


def _args(event: Any) -> Any:
    return (event.index, event.arguments, event.id) if isinstance(event, ToolCallDelta) else event


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_from_model_output_read_whole_and_token_by_token(
    smollm2_llm: LLM, name: str
) -> None:
    deltas = model_output(smollm2_llm, FORMATS[name])
    text = "".join(deltas)
    whole = read_whole(PARSERS[name](NAMES), text)
    assert whole == ("", "", [("get_weather", ARGUMENTS)])
    assert read(PARSERS[name](NAMES), deltas) == whole
    assert read(PARSERS[name](NAMES), list(text)) == whole
    start = text.index(ARGUMENTS)
    parser, expected, at = PARSERS[name](NAMES), [], 0
    for delta in deltas:  # each token's share of the arguments, sent with that token
        low, high = max(at, start), min(at + len(delta), start + len(ARGUMENTS))
        expected.append([text[low:high]] if low < high else [])
        at += len(delta)
    header = next(i for i, share in enumerate(expected) if share)
    sent = [parser.feed(delta) for delta in deltas]
    assert parser.finish() == [] and len(expected) - expected.count([]) >= 5
    call = sent[header].pop(0)
    assert isinstance(call, ToolCallDelta) and call.id is not None
    assert (call.index, call.name, call.arguments) == (0, "get_weather", "")
    assert [[_args(e) for e in events] for events in sent] == [
        [(0, share, None) for share in shares] for shares in expected
    ]


def test_reasoning_from_model_output_then_a_call(smollm2_llm: LLM) -> None:
    regex = "<think>[a-z ]{4,24}</think>\n\n" + FORMATS["hermes"]
    deltas = model_output(smollm2_llm, regex)
    text = "".join(deltas)
    thought = text[len("<think>") : text.index("</think>")]
    tools = plan([ToolDefinition.model_validate(WEATHER_TOOL)], None)
    reader = OutputFormat("hermes", True).reader(tools, "<|im_start|>assistant\n", None)
    assert read(reader, deltas) == (thought, "", [("get_weather", ARGUMENTS)])
    assert reader.finish_reason("stop") == "tool_calls"


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}


def test_a_block_opened_by_the_prompt_is_read_from_the_first_token() -> None:
    assert opened_in_prompt("<|Assistant|><think>\n") and not opened_in_prompt("<think></think>")
    splitter = ThinkSplitter(inside=True)
    events = splitter.feed("a pl") + splitter.feed("an</th") + splitter.feed("ink>\n\nDone")
    assert events + splitter.finish() == [Reasoning("a pl"), Reasoning("an"), "Done"]


def test_text_that_only_looks_like_a_block_is_content() -> None:
    for text in ("<thin", "<thinking>x", " plain <think>late</think>"):
        splitter = ThinkSplitter(inside=False)
        events = [e for c in text for e in splitter.feed(c)] + splitter.finish()
        assert "".join(e for e in events if isinstance(e, str)) == text
        assert not [e for e in events if isinstance(e, Reasoning)]
    unclosed = ThinkSplitter(inside=False)
    assert unclosed.feed("<think>still going") + unclosed.finish() == [Reasoning("still going")]


MALFORMED = {
    "deepseek_v3": [
        "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\nbad\n```<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>other<｜tool▁sep｜>{}<｜tool▁call▁end｜>",
    ],
    "llama3_json": ['{"name": "get_weather", "parameters": [1]}', '{"name": 1}', "{not json"],
    "mistral": ["[TOOL_CALLS][{}]", "[TOOL_CALLS]get_weather{}", "[TOOL_CALLS][1"],
    "hermes": ["<tool_call>[]</tool_call>", '<tool_call>{"name": "x"}</tool_call>'],
}
"""Broken before a call could be sent: content as written, streamed or not."""


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_calls_are_content_as_written(name: str) -> None:
    for text in MALFORMED[name]:
        assert read_whole(PARSERS[name](NAMES), text) == ("", text, [])
        for deltas in ([text], list(text)):
            assert read(PARSERS[name](NAMES), deltas) == ("", text, [])


SENT_THEN_BROKEN = {
    "deepseek_v3": [
        (
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{bad}\n```<｜tool▁call▁end｜>",
            ("", "bad}\n```<｜tool▁call▁end｜>", [("get_weather", "{")]),
        ),
        (
            "<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{}",
            ("", "", [("get_weather", "{}")]),
        ),
    ],
    "llama3_json": [
        (
            '{"name": "get_weather", "parameters": {"city": "Rome"}} and text',
            ("", "} and text", [("get_weather", '{"city": "Rome"}')]),
        )
    ],
    "mistral": [
        (
            '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro',
            ("", "", [("get_weather", '{"city": "Ro')]),
        )
    ],
    "hermes": [
        (
            '<tool_call>{"name": "get_weather", "arguments": {"city": 1.2.3}}</tool_call>',
            ("", "}}</tool_call>", [("get_weather", '{"city": 1.2.3')]),
        )
    ],
}
"""Broken after the call went out, streamed one character at a time: what was sent stays."""


@pytest.mark.parametrize("name", sorted(SENT_THEN_BROKEN))
def test_a_call_broken_after_it_went_out_keeps_it_and_the_rest_is_content(name: str) -> None:
    for text, streamed in SENT_THEN_BROKEN[name]:
        assert read_whole(PARSERS[name](NAMES), text) == ("", text, [])
        assert read(PARSERS[name](NAMES), list(text)) == streamed


def test_deepseek_v31_mistral_v11_and_llama_lists_are_read() -> None:
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Rome"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    rome = ("get_weather", '{"city": "Rome"}')
    assert read(DeepSeekParser(NAMES), list("Sure." + v31)) == ("", "Sure.", [rome])
    v11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"}[TOOL_CALLS]get_weather[ARGS]{}'
    calls = [rome, ("get_weather", "{}")]
    assert read(MistralParser(NAMES), list(v11)) == ("", "", calls)
    llama = (
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
        '{"name": "get_weather", "parameters": {}}'
    )
    assert read(Llama3JsonParser(NAMES), list(llama)) == ("", "", calls)
    assert read(Llama3JsonParser(NAMES), list("It is {sunny}.")) == ("", "It is {sunny}.", [])


@pytest.fixture(scope="module")
def mistral_marked(smollm2_tokenizer: Any, tmp_path_factory: pytest.TempPathFactory) -> LLM:
    """A tiny Mistral whose tokenizer (SmolLM2's) has ``[TOOL_CALLS]`` as a special token, as
    Mistral's Hugging Face tokenizers have, and that writes it wherever a regex allows it:
    dimension 0 of its residual stream is a constant (1 in every embedding, written by no
    layer), which only that token's output row reads, strongly."""
    tokenizer = copy.deepcopy(smollm2_tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": [MistralParser.open]})
    path = tmp_path_factory.mktemp("mistral_marked")
    model, _ = tiny_model(tokenizer, path, "mistral")
    with torch.no_grad():
        model.model.embed_tokens.weight[:, 0] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        model.lm_head.weight[:, 0] = 0.0
        model.lm_head.weight[tokenizer.convert_tokens_to_ids(MistralParser.open), 0] = 100.0
    model.save_pretrained(path, safe_serialization=True)
    config = EngineConfig(model=str(path), max_model_len=256, num_kv_blocks=64)
    return LLM.from_engine(LLMEngine(config, tokenizer=tokenizer))


def test_a_special_tool_mark_is_kept_for_the_parser_streamed_and_not(
    mistral_marked: LLM,
) -> None:
    tokenizer = mistral_marked.engine.tokenizer
    mark = tokenizer.convert_tokens_to_ids(MistralParser.open)
    output = OutputFormat.of(ServerConfig(), tokenizer)
    assert (output.tool_format, output.tool_marks) == ("hermes", ())  # SmolLM2's template
    output = OutputFormat.of(ServerConfig(tool_call_parser="mistral"), tokenizer)
    assert output.tool_marks == (mark,)
    tools = plan([ToolDefinition.model_validate(WEATHER_TOOL)], None)
    assert output.kept_tokens(tools, None) == [mark]
    assert (
        output.kept_tokens(plan([ToolDefinition.model_validate(WEATHER_TOOL)], "none"), None) == []
    )
    deltas = model_output(mistral_marked, FORMATS["mistral"], kept=(mark,))
    text = "".join(deltas)
    assert text.startswith(MistralParser.open) and deltas[0] == MistralParser.open
    arguments = text[text.index('{"city"') : -2]
    expected = ("", "", [("get_weather", arguments)])
    assert read_whole(MistralParser(NAMES), text) == read(MistralParser(NAMES), deltas) == expected


def test_the_format_follows_the_chat_template_unless_configured() -> None:
    assert detect("{{'<｜tool▁call▁begin｜>' + tool['type'] }}") == "deepseek_v3"
    assert detect("{{ '[TOOL_CALLS]' + tool_calls|tojson }}") == "mistral"
    assert detect("<tool_call>\\n{{ tool_call | tojson }}\\n</tool_call>") == "hermes"
    assert detect('{{ "<|python_tag|>" }}{"name": ..., "parameters": ...}') == "llama3_json"
    assert detect(None) == "hermes"

    class Tokenizer:
        chat_template = "{{ '<think>' }}[TOOL_CALLS]"

    assert OutputFormat.of(ServerConfig(), Tokenizer()) == OutputFormat("mistral", True)
    chosen = ServerConfig(tool_call_parser="llama3_json", reasoning_parser="none")
    assert OutputFormat.of(chosen, Tokenizer()) == OutputFormat("llama3_json", False)


def test_blocks_group_events_in_order() -> None:
    blocks = Blocks()
    call = ToolCallDelta(0, '{"a"', "call_1", "f")
    steps = blocks.feed([Reasoning("hm"), Reasoning("m"), "Hi", call, ToolCallDelta(0, ": 1}")])
    steps += blocks.close()
    assert [(what, b.index, b.kind, text) for what, b, text in steps] == [
        ("start", 0, "reasoning", ""),
        ("delta", 0, "reasoning", "hm"),
        ("delta", 0, "reasoning", "m"),
        ("stop", 0, "reasoning", ""),
        ("start", 1, "text", ""),
        ("delta", 1, "text", "Hi"),
        ("stop", 1, "text", ""),
        ("start", 2, "call", ""),
        ("delta", 2, "call", '{"a"'),
        ("delta", 2, "call", ": 1}"),
        ("stop", 2, "call", ""),
    ]
    assert [(b.kind, b.text, b.name) for b in blocks.done] == [
        ("reasoning", "hmm", None),
        ("text", "Hi", None),
        ("call", '{"a": 1}', "f"),
    ]
