"""One choice's output as the APIs read it: reasoning, content and tool calls, as it streams
(``ChoiceReader``), and as the blocks that Responses and Messages report (``Blocks``).

How the served model writes reasoning and tool calls is ``OutputFormat``, fixed at start from
the config and the chat template; each request adds whether its prompt left a ``<think>``
block open and its tools (tools.py ``ToolPlan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.server_config import ServerConfig
from splitserve.services.api.reasoning import (
    CLOSE,
    OPEN,
    Reasoning,
    ThinkSplitter,
    opened_in_prompt,
    reads_reasoning,
)
from splitserve.services.api.tool_calls import OutputParser, ToolCallDelta, merge
from splitserve.services.api.tool_formats import PARSERS, detect
from splitserve.services.api.tools import ToolPlan

OutputEvent = Reasoning | str | ToolCallDelta


@dataclass(frozen=True)
class OutputFormat:
    """tool_format: a key of tool_formats.PARSERS; reasoning: ``<think>`` blocks are read;
    tool_marks, think_marks: the ids of the format's marks that the tokenizer holds as special
    tokens, which the detokenizer would drop (Mistral's ``[TOOL_CALLS]``): a request whose
    output is read by them keeps them in its text (``kept_tokens``)."""

    tool_format: str = "hermes"
    reasoning: bool = False
    tool_marks: tuple[int, ...] = ()
    think_marks: tuple[int, ...] = ()

    @classmethod
    def of(cls, server: ServerConfig, tokenizer: Any) -> OutputFormat:
        template = getattr(tokenizer, "chat_template", None)
        template = template if isinstance(template, str) else None
        name = server.tool_call_parser
        tool_format = detect(template) if name == "auto" else name
        return cls(
            tool_format,
            reads_reasoning(server.reasoning_parser, template),
            special_marks(tokenizer, PARSERS[tool_format].marks),
            special_marks(tokenizer, (OPEN, CLOSE)),
        )

    def reader(
        self, tools: ToolPlan, prompt_tail: str, thinking_asked: bool | None
    ) -> ChoiceReader:
        """A reader for one choice of a request with these tools whose rendered prompt ends
        with ``prompt_tail``; ``thinking_asked``: the request's own switch (its template's
        ``enable_thinking``), None for the server's. A forced call (its grammar starts the
        output) has no reasoning."""
        parser = tools.parser(PARSERS[self.tool_format])
        thinking = None
        if self._thinks(tools, thinking_asked):
            thinking = ThinkSplitter(opened_in_prompt(prompt_tail))
        return ChoiceReader(parser, thinking)

    def kept_tokens(self, tools: ToolPlan, thinking_asked: bool | None) -> list[int]:
        """The special tokens that the request's reader reads, to keep in its output."""
        kept = list(self.tool_marks) if tools.mode == "auto" else []
        return kept + (list(self.think_marks) if self._thinks(tools, thinking_asked) else [])

    def _thinks(self, tools: ToolPlan, thinking_asked: bool | None) -> bool:
        reads = self.reasoning if thinking_asked is None else thinking_asked
        return reads and not tools.forced


def special_marks(tokenizer: Any, marks: tuple[str, ...]) -> tuple[int, ...]:
    """The ids of the marks that are each one special token of the tokenizer, one that
    decoding with skip_special_tokens drops (a tokenizer without a vocabulary of named
    tokens, such as a random shape's, has none)."""
    convert = getattr(tokenizer, "convert_tokens_to_ids", None)
    if convert is None:
        return ()
    ids = []
    for mark in marks:
        token = convert(mark)
        if (
            isinstance(token, int)
            and tokenizer.decode([token], skip_special_tokens=False) == mark
            and not tokenizer.decode([token], skip_special_tokens=True)
        ):
            ids.append(token)
    return tuple(ids)


class ChoiceReader:
    """Text deltas in, events out: ``Reasoning``, content text, ``ToolCallDelta``."""

    def __init__(self, tools: OutputParser, thinking: ThinkSplitter | None) -> None:
        self.tools = tools
        self.thinking = thinking

    def feed(self, text: str) -> list[OutputEvent]:
        return self._route(self.thinking.feed(text) if self.thinking else [text])

    def finish(self) -> list[OutputEvent]:
        events = self._route(self.thinking.finish() if self.thinking else [])
        return events + list(self.tools.finish())

    def finish_reason(self, reason: str | None) -> str | None:
        return self.tools.finish_reason(reason)

    def _route(self, parts: list[Reasoning | str]) -> list[OutputEvent]:
        events: list[OutputEvent] = []
        for part in parts:
            events += [part] if isinstance(part, Reasoning) else self.tools.feed(part)
        return events

    def read(self, text: str) -> list[OutputEvent]:
        """A whole output's events, not streamed: calls are reported only once complete."""
        self.tools.hold = True
        return self.feed(text) + self.finish()

    def whole(self, text: str) -> tuple[str | None, str | None, list[dict[str, Any]]]:
        """A whole choice's (reasoning, content, tool_calls): reasoning None without a
        reasoning reader, content None when there are calls and no other text."""
        events = self.read(text)
        thought = "".join(e.text for e in events if isinstance(e, Reasoning))
        content, calls = merge([e for e in events if not isinstance(e, Reasoning)])
        return (thought if self.thinking else None), content, calls


@dataclass
class Block:
    """One output block: reasoning, text, or a call (its arguments as ``text``)."""

    index: int
    kind: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None


Step = tuple[str, Block, str]


@dataclass
class Blocks:
    """Events grouped into consecutive blocks, reported as steps: ("start", block, ""),
    ("delta", block, text), ("stop", block, "")."""

    done: list[Block] = field(default_factory=list)
    current: Block | None = None

    def feed(self, events: list[OutputEvent]) -> list[Step]:
        steps: list[Step] = []
        for event in events:
            kind, text = _kind(event)
            call = event if isinstance(event, ToolCallDelta) and event.id is not None else None
            if self.current is None or self.current.kind != kind or call is not None:
                steps += self.close()
                self.current = Block(len(self.done), kind)
                if call is not None:
                    self.current.call_id, self.current.name = call.id, call.name
                steps.append(("start", self.current, ""))
            if text:
                self.current.text += text
                steps.append(("delta", self.current, text))
        return steps

    def close(self) -> list[Step]:
        block, self.current = self.current, None
        if block is None:
            return []
        self.done.append(block)
        return [("stop", block, "")]


def _kind(event: OutputEvent) -> tuple[str, str]:
    if isinstance(event, Reasoning):
        return "reasoning", event.text
    if isinstance(event, str):
        return "text", event
    return "call", event.arguments
