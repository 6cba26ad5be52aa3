"""tool_choice auto: calls written in regions that open with a mark, the text outside them
content (``MarkedParser``; the formats are in tool_formats.py), read as they stream.

A region is read one character at a time by its format's grammar (call_grammar.py), so it is
known to be well-formed as far as it is written. A call is reported (index, id, name) once its
name is read, an offered tool's, and its arguments have begun (a JSON object); its arguments
then follow as written, as far as each feed takes them. Their text is the model's, never
re-serialized: the fragments put together are the non-streamed arguments exactly.

A region that breaks (it does not read as calls of offered tools with object arguments, or the
output ends inside it) is content as written, never an error. Non-streamed (``hold``), nothing
of a region is reported before it is complete, so that is always so. Streamed, what was sent
stays sent: when a region breaks after its first call was reported, the calls keep what they
were sent (the last one's arguments cut where it broke; ``finish_reason`` is then not
``tool_calls``) and the rest of the region is content; no text is lost either way.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.services.api.call_grammar import (
    END,
    Broken,
    Reader,
    members,
    string,
    value,
)
from splitserve.services.api.tool_calls import Event, OutputParser, ToolCallDelta, partial_suffix


@dataclass
class Call:
    """One call of a region; positions are in the region's text."""

    name: str | None = None
    start: int | None = None  # its arguments' "{"
    end: int | None = None  # just past their "}"
    closed: int | None = None  # just past the call, when it had no arguments ("{}")
    index: int | None = None  # among the output's calls, once reported
    sent: int = 0  # its arguments are reported up to here


@dataclass
class Region:
    mark: str  # the open mark, as written
    reader: Reader = field(init=False)
    text: str = ""  # after the mark
    calls: list[Call] = field(default_factory=list)
    sent: int = 0  # the text up to here is reported, as calls
    reported: bool = False


class MarkedParser(OutputParser):
    """open: the mark a region starts with; dropped: marks around the regions that are never
    content; marks: all of the format's (output.py keeps those the tokenizer holds as
    special tokens). Text that may be the start of ``open`` or of a dropped mark is held back
    until it is known, and the content's trailing whitespace until more content follows: it
    is dropped when the output has calls.

    names: the offered tools' names."""

    open = ""
    dropped: tuple[str, ...] = ()
    marks: tuple[str, ...] = ()

    def __init__(self, names: frozenset[str]) -> None:
        super().__init__()
        self.names = names
        self.raw = ""  # input that may be the start of a dropped mark
        self.buffer = ""  # outside a region: text that may be the start of the open mark
        self.pending = ""
        self.region: Region | None = None
        self.at = 0  # the region's character being read
        self.cut = False  # a reported call's arguments broke off

    def grammar(self) -> Reader:
        """Reads one region, from the character after its open mark."""
        raise NotImplementedError

    def feed(self, text: str) -> list[Event]:
        self.raw += text
        for mark in self.dropped:
            self.raw = self.raw.replace(mark, "")
        keep = max((partial_suffix(self.raw, mark) for mark in self.dropped), default=0)
        text, self.raw = self.raw[: len(self.raw) - keep], self.raw[len(self.raw) - keep :]
        events = self._take(text)
        if self.region is not None and not self.hold:
            events += self._report(self.region, len(self.region.text), True)
        return events

    def finish(self) -> list[Event]:
        events = self._take(self.raw)
        self.raw = ""
        if self.region is not None:
            events += self._end(self.region)
        events += self._content(self.buffer)
        self.buffer = ""
        if self.pending and not self.calls:
            events.append(self.pending)
        return events

    def finish_reason(self, reason: str | None) -> str | None:
        return reason if self.cut else super().finish_reason(reason)

    def _take(self, text: str) -> list[Event]:
        events: list[Event] = []
        while text:
            text = self._inside(text, events) if self.region else self._outside(text, events)
        return events

    def _outside(self, text: str, events: list[Event]) -> str:
        """Content up to the open mark; returns the text after it, its region opened."""
        self.buffer += text
        at = self.buffer.find(self.open)
        if at < 0:
            cut = len(self.buffer) - partial_suffix(self.buffer, self.open)
            events += self._content(self.buffer[:cut])
            self.buffer = self.buffer[cut:]
            return ""
        events += self._content(self.buffer[:at])
        rest, self.buffer = self.buffer[at + len(self.open) :], ""
        self._open(self.open)
        return rest

    def _open(self, mark: str) -> None:
        self.region = Region(mark)
        self.region.reader = self.grammar()
        next(self.region.reader)

    def _inside(self, text: str, events: list[Event]) -> str:
        """Reads text into the region; returns what follows it once it closes or breaks."""
        region = self.region
        assert region is not None
        base = len(region.text)
        region.text += text
        for i, c in enumerate(text):
            self.at = base + i
            try:
                region.reader.send(c)
            except StopIteration:
                events += self._close(region)
                return text[i + 1 :]
            except Broken:
                events += self._break(region, self.at)
                return text[i:]
        return ""

    def _end(self, region: Region) -> list[Event]:
        self.at = len(region.text)
        try:
            region.reader.send(END)
        except StopIteration:
            return self._close(region)
        except Broken:
            pass
        return self._break(region, self.at)

    def _close(self, region: Region) -> list[Event]:
        self.region = None
        return self._report(region, self.at + 1, True)

    def _break(self, region: Region, at: int) -> list[Event]:
        """The region broke at ``at``: content as written, or what follows the calls sent."""
        self.region = None
        if not region.reported:
            return self._content(region.mark + region.text[:at])
        events = self._report(region, at, False)
        self.cut |= any(
            c.index is not None and c.start is not None and c.end is None for c in region.calls
        )
        return events + self._content(region.text[region.sent : at])

    def _report(self, region: Region, upto: int, new: bool) -> list[Event]:
        """The region's calls as far as ``upto`` (new: calls not reported yet too)."""
        events: list[Event] = []
        for call in region.calls:
            if call.index is None:
                if not new or call.name is None or (call.start is None and call.closed is None):
                    break
                events.append(self._header(call.name, "{}" if call.start is None else ""))
                call.index, region.reported, self.pending = self.calls - 1, True, ""
                call.sent = region.sent = call.start if call.start is not None else call.closed or 0
            end = upto if call.end is None else min(upto, call.end)
            if call.start is not None and end > call.sent:
                events.append(ToolCallDelta(call.index, region.text[call.sent : end]))
                call.sent = region.sent = end
        return events

    def _content(self, text: str) -> list[Event]:
        text = self.pending + text
        body = text.rstrip()
        self.pending = text[len(body) :]
        return [body] if body else []

    # The grammar's pieces (tool_formats.py).

    def call(self, name: str) -> Call:
        """A call of ``name`` begins; Broken unless it is an offered tool."""
        assert self.region is not None
        if name not in self.names:
            raise Broken
        self.region.calls.append(Call(name))
        return self.region.calls[-1]

    def arguments(self, call: Call, c: str) -> Reader:
        """``call``'s arguments, a JSON object, from ``c``, its first character."""
        if c != "{":
            raise Broken
        call.start = self.at
        yield from value(c, 1)
        call.end = self.at + 1
        return None

    def call_object(self, c: str | None, keys: tuple[str, ...]) -> Reader:
        """``{"name": NAME, KEY: {...}}``, KEY one of ``keys`` (other members are read and
        left; no KEY: the arguments are ``{}``)."""
        assert self.region is not None
        call = Call()
        self.region.calls.append(call)

        def member(key: str, first: str) -> Reader:
            if key == "name" and call.name is None:
                name = yield from string(first)
                if name not in self.names:
                    raise Broken
                call.name = name
                return None
            if key in keys and call.start is None:
                return (yield from self.arguments(call, first))
            return (yield from value(first, 1))

        yield from members(c, member)
        if call.name is None:
            raise Broken
        call.closed = self.at + 1
        return None
