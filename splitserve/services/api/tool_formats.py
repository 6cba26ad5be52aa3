"""The tool-call formats of tool_choice auto beside Hermes (tool_calls.py), and which one a
model writes: ``server.tool_call_parser``, or with ``auto`` the one its chat template renders.

- ``deepseek_v3``: DeepSeek V3 / R1 ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` and the
  arguments in a fenced json block, then ``<｜tool▁call▁end｜>``; V3.1's ``NAME<｜tool▁sep｜>{...}``
  too. The ``<｜tool▁calls▁begin｜>`` / ``<｜tool▁calls▁end｜>`` marks around them are dropped.
- ``llama3_json``: Llama 3.x: an output that is ``{"name": ..., "parameters": {...}}`` (after
  an optional ``<|python_tag|>``), several separated by ``;``.
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list of ``{"name", "arguments"}``, or (newer
  templates) ``NAME[ARGS]{...}``, each call after its own ``[TOOL_CALLS]``.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve.services.api.tool_calls import Event, HermesParser, MarkedParser

FENCED = re.compile(r"\s*```(?:json)?\s*(.*?)\s*```\s*", re.DOTALL)


class DeepSeekParser(MarkedParser):
    open, close = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
    dropped = ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")
    SEP = "<｜tool▁sep｜>"

    def calls_in(self, region: str) -> list[tuple[Any, Any]] | None:
        head, sep, tail = region.partition(self.SEP)
        if not sep:
            return None
        if head.strip() == "function":  # V3 / R1: function<sep>NAME\n```json ... ```
            name, _, fenced = tail.partition("\n")
            match = FENCED.fullmatch(fenced)
            if match is None:
                return None
            return [(name.strip(), json.loads(match.group(1)))]
        return [(head.strip(), json.loads(tail))]  # V3.1: NAME<sep>{...}


class MistralParser(MarkedParser):
    open = "[TOOL_CALLS]"
    ARGS = "[ARGS]"

    def calls_in(self, region: str) -> list[tuple[Any, Any]] | None:
        found: list[tuple[Any, Any]] = []
        for part in region.split(self.open):
            if part.lstrip().startswith("["):
                calls = json.loads(part)
                if not isinstance(calls, list):
                    return None
                found += [_named(call, "arguments") for call in calls]
            else:
                name, sep, arguments = part.partition(self.ARGS)
                if not sep:
                    return None
                found.append((name.strip(), json.loads(arguments)))
        return found


class Llama3JsonParser(MarkedParser):
    """Calls only when the whole output is calls: the output is read as such once it starts
    with ``{`` or ``<|python_tag|>`` (leading whitespace aside)."""

    TAG = "<|python_tag|>"

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__(names)
        self.started = False

    def feed(self, text: str) -> list[Event]:
        if self.started:
            return super().feed(text)
        self.buffer += text
        head = self.buffer.lstrip()
        if head.startswith((self.TAG, "{")):
            self.started = self.inside = True
            self.buffer = head.removeprefix(self.TAG)
            return []
        if head and not self.TAG.startswith(head):
            self.started = True
            text, self.buffer = self.buffer, ""
            return super().feed(text)
        return []

    def calls_in(self, region: str) -> list[tuple[Any, Any]] | None:
        decoder = json.JSONDecoder()
        found, at = [], 0
        while at < len(region):
            call, end = decoder.raw_decode(region, at)
            key = "parameters" if isinstance(call, dict) and "parameters" in call else "arguments"
            found.append(_named(call, key))
            rest = region[end:].lstrip()
            if rest and not rest.startswith(";"):
                return None
            at = len(region) - len(rest.removeprefix(";").lstrip())
        return found


def _named(call: Any, key: str) -> tuple[Any, Any]:
    if not isinstance(call, dict):
        return None, None
    return call.get("name"), call.get(key, {})


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
