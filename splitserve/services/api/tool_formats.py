"""The tool-call formats of tool_choice auto, each a grammar of its regions (marked_calls.py),
and which one a model writes: ``server.tool_call_parser``, or with ``auto`` the one its chat
template renders.

- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.
- ``deepseek_v3``: DeepSeek V3 / R1 ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and the
  arguments in a fenced json block, then ``<｜tool▁call▁end｜>``; V3.1's ``NAME<｜tool▁sep｜>{...}``
  too. The ``<｜tool▁calls▁begin｜>`` / ``<｜tool▁calls▁end｜>`` marks around them are dropped.
- ``llama3_json``: Llama 3.x: an output that is ``{"name": ..., "parameters": {...}}`` (after
  an optional ``<|python_tag|>``), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  templates) ``NAME[ARGS]{...}``, each call after its own ``[TOOL_CALLS]``.
"""

from __future__ import annotations

from splitserve.services.api.call_grammar import (
    END,
    Broken,
    Reader,
    literal,
    space,
    until,
)
from splitserve.services.api.marked_calls import MarkedParser
from splitserve.services.api.tool_calls import Event

NAME_LIMIT = 64
"""The longest a function name is (tools.FUNCTION_NAME)."""


class HermesParser(MarkedParser):
    open, CLOSE = "<tool_call>", "</tool_call>"
    marks = (open, CLOSE)

    def grammar(self) -> Reader:
        c = yield from space(None)
        yield from self.call_object(c, ("arguments",))
        c = yield from space(None)
        return (yield from literal(c, self.CLOSE))


class DeepSeekParser(MarkedParser):
    open, CLOSE = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    dropped = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP, FENCE = "<｜tool▁sep｜>", "```"
    marks = (open, CLOSE, SEP, *dropped)

    def grammar(self) -> Reader:
        head = yield from until(None, self.SEP, NAME_LIMIT)
        if head.strip() == "function":  # V3 / R1: function<sep>NAME\n```json\n{...}\n```
            call = self.call((yield from until(None, "\n", NAME_LIMIT)).strip())
            c = yield from space(None)
            yield from literal(c, self.FENCE)
            c = yield
            if c == "j":
                yield from literal(c, "json")
                c = yield
            c = yield from space(c)
            yield from self.arguments(call, c)
            c = yield from space(None)
            yield from literal(c, self.FENCE)
        else:  # V3.1: NAME<sep>{...}
            call = self.call(head.strip())
            yield from self.arguments(call, (yield from space(None)))
        c = yield from space(None)
        return (yield from literal(c, self.CLOSE))


class MistralParser(MarkedParser):
    open = "[TOOL_CALLS]"
    ARGS = "[ARGS]"
    marks = (open, ARGS)

    def grammar(self) -> Reader:
        c = yield from space(None)
        while True:
            if c == "[":
                yield from self._list()
            else:
                call = self.call((yield from until(c, self.ARGS, NAME_LIMIT)).strip())
                yield from self.arguments(call, (yield from space(None)))
            c = yield from space(None)
            if c == END:
                return None
            yield from literal(c, self.open)
            c = yield from space(None)

    def _list(self) -> Reader:
        """``[{"name": ..., "arguments": {...}}, ...]`` from its ``[``, at least one call."""
        c = yield from space(None)
        while True:
            yield from self.call_object(c, ("arguments",))
            c = yield from space(None)
            if c == "]":
                return None
            yield from literal(c, ",")
            c = yield from space(None)


class Llama3JsonParser(MarkedParser):
    """Calls only when the whole output is calls: the output is read as such once it starts
    with ``{`` or ``<|python_tag|>`` (leading whitespace aside), as content otherwise."""

    TAG = "<|python_tag|>"
    marks = (TAG,)

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.started = False

    def grammar(self) -> Reader:
        c = yield from space(None)
        while True:
            yield from self.call_object(c, ("parameters", "arguments"))
            c = yield from space(None)
            if c == END:
                return None
            if c != ";":
                raise Broken
            c = yield from space(None)

    def _outside(self, text: str, events: list[Event]) -> str:
        if self.started:
            events += self._content(text)
            return ""
        self.buffer += text
        head = self.buffer.lstrip()
        if head.startswith((self.TAG, "{")):
            self.started = True
            mark = self.buffer[: len(self.buffer) - len(head)]
            mark += self.TAG if head.startswith(self.TAG) else ""
            rest, self.buffer = self.buffer[len(mark) :], ""
            self._open(mark)
            return rest
        if head and not self.TAG.startswith(head):
            self.started = True
            events += self._content(self.buffer)
            self.buffer = ""
        return ""


PARSERS: dict[str, type[MarkedParser]] = {
    "hermes": HermesParser,
    "deepseek_v3": DeepSeekParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def detect(chat_template: str | None) -> str:
    """The format a chat template renders tool calls in (Hermes when it says nothing)."""
    template = chat_template or ""
    if "<｜tool▁call▁begin｜>" in template:
        return "deepseek_v3"
    if "[TOOL_CALLS]" in template:
        return "mistral"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or '"parameters": ' in template:
        return "llama3_json"
    return "hermes"
