"""The pieces tool-call regions are read with, one character at a time (marked_calls.py): each
is a generator sent the text's characters, ``END`` after the last one, that raises ``Broken``
at the first character that cannot continue it. So a region's calls are known to be
well-formed as far as they are written, which lets them stream as the model writes them.

A piece takes ``c``, the character in hand (None: none yet, the next one sent is its first),
and returns the character it read past its end, or None when its own last character ended it.
JSON is read as RFC 8259 writes it, nesting at most MAX_DEPTH deep and with no lone UTF-16
surrogate escape in a string (``"\\ud800"``: valid JSON text, not Unicode, which a response
could not encode once parsed).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Generator

from splitserve.services.api.json_body import MAX_DEPTH

END = ""
"""Sent after the output's last character."""

Reader = Generator[None, str, str | None]
"""A piece: returns the character read past its end (None: it ended on its own)."""
Members = Callable[[str, str], Reader]
"""Reads an object member's value: (its key, the value's first character)."""

SPACE = " \t\n\r"
"""JSON's whitespace."""
HEX = frozenset("0123456789abcdefABCDEF")
ESCAPES = frozenset('"\\/bfnrt')
NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?")
WORDS = {"t": "true", "f": "false", "n": "null"}


class Broken(Exception):
    """The character sent cannot continue what is read."""


def char(c: str | None) -> Generator[None, str, str]:
    """The character in hand, or the next one sent."""
    if c is None:
        c = yield
    return c


def space(c: str | None) -> Generator[None, str, str]:
    """Whitespace: returns the first other character (END included)."""
    c = yield from char(c)
    while c and c in SPACE:
        c = yield
    return c


def literal(c: str | None, mark: str) -> Reader:
    for expected in mark:
        c = yield from char(c)
        if c != expected:
            raise Broken
        c = None
    return None


def until(c: str | None, mark: str, limit: int) -> Generator[None, str, str]:
    """Text up to ``mark`` (at most ``limit`` characters), the mark read: returns the text."""
    text = ""
    while not text.endswith(mark):
        c = yield from char(c)
        if c == END or len(text) >= limit + len(mark):
            raise Broken
        text, c = text + c, None
    return text[: -len(mark)]


def value(c: str | None, depth: int = 0) -> Reader:
    """Any JSON value (depth: of the container it is in)."""
    c = yield from char(c)
    if c == "{":
        return (yield from members(c, lambda _, first: value(first, depth + 1), depth))
    if c == "[":
        return (yield from items(c, depth))
    if c == '"':
        yield from string(c)
        return None
    if c in WORDS:
        return (yield from literal(c, WORDS[c]))
    if c == "-" or c.isdigit():
        return (yield from number(c))
    raise Broken


def members(c: str | None, read: Members, depth: int = 0) -> Reader:
    """An object, each member's value read by ``read``."""
    c = yield from char(c)
    if c != "{" or depth >= MAX_DEPTH:
        raise Broken
    c = yield from space(None)
    if c == "}":
        return None
    while True:
        key = yield from string(c)
        c = yield from space(None)
        yield from literal(c, ":")
        c = yield from space(None)
        c = yield from space((yield from read(key, c)))
        if c == "}":
            return None
        yield from literal(c, ",")
        c = yield from space(None)


def items(c: str | None, depth: int) -> Reader:
    c = yield from char(c)
    if c != "[" or depth >= MAX_DEPTH:
        raise Broken
    c = yield from space(None)
    if c == "]":
        return None
    while True:
        c = yield from space((yield from value(c, depth + 1)))
        if c == "]":
            return None
        yield from literal(c, ",")
        c = yield from space(None)


def string(c: str | None) -> Generator[None, str, str]:
    """A string: returns its value."""
    c = yield from char(c)
    if c != '"':
        raise Broken
    written = [c]
    high = False  # the last escape was a high surrogate, which a low one must follow
    while True:
        c = yield
        if c < " ":  # END, or a control character
            raise Broken
        written.append(c)
        if c == "\\":
            c = yield
            written.append(c)
            if c == "u":
                code = int((yield from hex4()), 16)
                written.append(f"{code:04x}")
                if high != (0xDC00 <= code <= 0xDFFF):
                    raise Broken
                high = 0xD800 <= code <= 0xDBFF
                continue
            if c not in ESCAPES or high:
                raise Broken
            continue
        if high:
            raise Broken
        if c == '"':
            return str(json.loads("".join(written)))


def hex4() -> Generator[None, str, str]:
    digits = ""
    for _ in range(4):
        c = yield
        if c not in HEX:
            raise Broken
        digits += c
    return digits


def number(c: str | None) -> Reader:
    c = yield from char(c)
    written = ""
    while c and c in "+-.0123456789eE":
        written, c = written + c, (yield)
    if not NUMBER.fullmatch(written):
        raise Broken
    return c
