"""Reasoning: the ``<think>...</think>`` convention of DeepSeek-R1 / V3.1 and Qwen3, split out
of a choice's text as it streams (``reasoning_content`` in chat, reasoning items in Responses,
thinking blocks in Messages).

``server.reasoning_parser``: ``auto`` reads reasoning when the chat template writes
``<think>``, ``think`` always, ``none`` never. A template may open the block itself in the
generation prompt (DeepSeek-R1; Qwen3 closes it there when ``enable_thinking`` is false): the
output then starts inside it. Otherwise the output is reasoning only when it opens with
``<think>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.services.api.tool_calls import partial_suffix

OPEN, CLOSE = "<think>", "</think>"


@dataclass
class Reasoning:
    """Reasoning text (an event beside content text and tool-call deltas)."""

    text: str


def reads_reasoning(mode: str, chat_template: str | None) -> bool:
    return mode == "think" or (mode == "auto" and OPEN in (chat_template or ""))


def opened_in_prompt(prompt_tail: str) -> bool:
    """Whether the rendered prompt's end left a ``<think>`` block open."""
    return prompt_tail.rfind(OPEN) > prompt_tail.rfind(CLOSE)


class ThinkSplitter:
    """One choice's text as reasoning and content. States: ``start`` (not known yet whether
    the output opens a block), ``inside``, ``after`` (the block closed: whitespace before the
    content is dropped), ``content``."""

    def __init__(self, inside: bool) -> None:
        self.state = "inside" if inside else "start"
        self.buffer = ""

    def feed(self, text: str) -> list[Reasoning | str]:
        self.buffer += text
        if self.state == "start":
            head = self.buffer.lstrip()
            if head.startswith(OPEN):
                self.state, self.buffer = "inside", head[len(OPEN) :]
            elif OPEN.startswith(head):
                return []
            else:
                self.state = "content"
        events: list[Reasoning | str] = []
        if self.state == "inside":
            at = self.buffer.find(CLOSE)
            if at < 0:
                cut = len(self.buffer) - partial_suffix(self.buffer, CLOSE)
                thought, self.buffer = self.buffer[:cut], self.buffer[cut:]
                return [Reasoning(thought)] if thought else []
            thought, self.buffer = self.buffer[:at], self.buffer[at + len(CLOSE) :]
            events += [Reasoning(thought)] if thought else []
            self.state = "after"
        if self.state == "after":
            self.buffer = self.buffer.lstrip()
            if not self.buffer:
                return events
            self.state = "content"
        text, self.buffer = self.buffer, ""
        return [*events, text] if text else events

    def finish(self) -> list[Reasoning | str]:
        """What is held back: an unclosed block's last reasoning, or text that only began
        like ``<think>``."""
        rest, self.buffer = self.buffer, ""
        if not rest:
            return []
        return [Reasoning(rest)] if self.state == "inside" else [rest]
