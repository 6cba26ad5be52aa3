"""Reading tool calls out of a choice's generated text, as it streams.

Each choice of a chat request gets an ``OutputParser``: fed the text deltas in order, it
returns what the client is sent, content text or ``ToolCallDelta``s (a call's id and name
first, then its arguments). The non-streamed message is the same events merged (read with
``hold``), so a streamed answer and a full one do not differ, but for an auto call that
breaks after it was streamed (marked_calls.py).

- ``OutputParser``: no tools (or tool_choice none): the text is the content.
- ``NamedParser``: a named function: the whole output is its arguments (held to its schema).
- ``ListParser``: tool_choice required: the output is ``[{"name": ..., "arguments": {...}},
  ...]`` (held to the tools by the grammar); each call streams as it is written.
- ``MarkedParser`` (marked_calls.py): tool_choice auto: calls in regions that open with a
  mark, the text outside them content, in the model's format (tool_formats.py).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any


@dataclass
class ToolCallDelta:
    """Part of tool call ``index``: its first delta has ``id`` and ``name``."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


Event = str | ToolCallDelta
"""What a parser reports: content text, or part of a tool call."""


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class OutputParser:
    """The text is the content; no tool calls."""

    def __init__(self) -> None:
        self.calls = 0
        self.hold = False  # the output is read whole, not streamed (marked_calls.py)

    def feed(self, text: str) -> list[Event]:
        return [text] if text else []

    def finish(self) -> list[Event]:
        return []

    def whole(self, text: str) -> list[Event]:
        """A whole output's events (not streamed): a parser that streams calls before they
        are complete (marked_calls.py) reports them only once they are."""
        self.hold = True
        return self.feed(text) + self.finish()

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's ``tool_calls`` for an output that ended with its calls complete."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _header(self, name: str, arguments: str = "") -> ToolCallDelta:
        self.calls += 1
        return ToolCallDelta(self.calls - 1, arguments, new_call_id(), name)


class NamedParser(OutputParser):
    """tool_choice names one function: the output is its arguments."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = [] if self.calls else [self._header(self.name)]
        if text:
            events.append(ToolCallDelta(0, text))
        return events

    def finish(self) -> list[Event]:
        return [] if self.calls else [self._header(self.name)]


class ListParser(OutputParser):
    """tool_choice required: a JSON list of {"name", "arguments"} objects, read one character
    at a time (depth 1 is the list, depth 2 an item). A call is reported once its name is
    complete, its arguments as far as they are written."""

    def __init__(self) -> None:
        super().__init__()
        self.text = ""
        self.pos = 0
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.token_start = 0
        self._new_item()

    def _new_item(self) -> None:
        self.key: str | None = None
        self.expect_key = True
        self.value_pending = False
        self.named = False
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_sent = 0

    def feed(self, text: str) -> list[Event]:
        self.text += text
        events: list[Event] = []
        while self.pos < len(self.text):
            self._step(self.text[self.pos], events)
            self.pos += 1
        self._send_arguments(events)
        return events

    def _step(self, c: str, events: list[Event]) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 2:
                    self._item_string(
                        json.loads(self.text[self.token_start : self.pos + 1]), events
                    )
            return
        if self.depth == 2 and self.value_pending and not c.isspace():
            self.value_pending = False
            if self.key == "arguments":
                self.args_start = self.args_sent = self.pos
        if c == '"':
            self.in_string = True
            self.token_start = self.pos
        elif c in "{[":
            self.depth += 1
            if self.depth == 2:
                self._new_item()
        elif self.depth == 2 and c in ",}]":
            if self.args_start is not None and self.args_end is None:
                self.args_end = self.pos
                self._send_arguments(events)
            self.expect_key = True
        elif c == ":" and self.depth == 2:
            self.value_pending = True
        if c in "}]":
            self.depth -= 1

    def _item_string(self, value: Any, events: list[Event]) -> None:
        if self.expect_key:
            self.key, self.expect_key = str(value), False
        elif self.key == "name" and not self.named:
            self.named = True
            events.append(self._header(str(value)))

    def _send_arguments(self, events: list[Event]) -> None:
        if not self.named or self.args_start is None:
            return
        end = self.args_end if self.args_end is not None else len(self.text)
        if end > self.args_sent:
            events.append(ToolCallDelta(self.calls - 1, self.text[self.args_sent : end]))
            self.args_sent = end


def partial_suffix(text: str, mark: str) -> int:
    """The length of the longest end of ``text`` that is a beginning of ``mark``."""
    for size in range(min(len(text), len(mark) - 1), 0, -1):
        if mark.startswith(text[-size:]):
            return size
    return 0


def message(parser: OutputParser, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """A whole choice's (content, tool_calls): its text through the parser, merged."""
    return merge(parser.whole(text))


def merge(events: list[Event]) -> tuple[str | None, list[dict[str, Any]]]:
    """Events merged into (content, tool_calls). The content is None when there are calls
    and no other text."""
    content = "".join(e for e in events if isinstance(e, str))
    calls: list[dict[str, Any]] = []
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if event.id is not None:
            calls.append(tool_call(event))
        else:
            calls[event.index]["function"]["arguments"] += event.arguments
    return (content or None) if calls else content, calls


def tool_call(event: ToolCallDelta) -> dict[str, Any]:
    """The first delta of a call as OpenAI's tool_call object."""
    return {
        "id": event.id,
        "type": "function",
        "function": {"name": event.name, "arguments": event.arguments},
    }


def stream_delta(event: ToolCallDelta) -> dict[str, Any]:
    """A streamed chunk's delta: the call's index, with id, type and name the first time."""
    if event.id is not None:
        return {"tool_calls": [{"index": event.index, **tool_call(event)}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}
