"""The msgpack form of the message dataclasses (services/messages.py): a dataclass is the list
of its field values, nested dataclasses as lists too, checked against the field types on the
way in. A codec per type is built once from the type hints, so a prompt's list[int] is checked
in one pass and passed through, not walked value by value (that walk was 3-5 ms per 1k-token
request on each side of a socket)."""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any

Codec = Callable[[Any], Any]

_SCALARS: dict[type, tuple[type, ...]] = {
    int: (int,),
    float: (float, int),
    str: (str,),
    bool: (bool,),
    bytes: (bytes,),
}


def _same(value: Any) -> Any:
    return value


@cache
def encoder(tp: Any) -> Codec:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        names, hints = _fields(tp)
        fields = [(name, encoder(hints[name])) for name in names]
        return lambda value: [encode_field(getattr(value, name)) for name, encode_field in fields]
    origin = typing.get_origin(tp)
    if origin is list:
        item = encoder(typing.get_args(tp)[0])
        return _same if item is _same else lambda value: [item(v) for v in value]
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) > 1:
            return _to_wire
        one = encoder(inner[0])
        return _same if one is _same else lambda value: None if value is None else one(value)
    return _same if tp in _SCALARS or origin is dict else _to_wire


def _to_wire(value: Any) -> Any:
    """The generic encoder, by the value's own type (a field typed as a union of several)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return encoder(type(value))(value)
    if isinstance(value, list | tuple):
        return [_to_wire(v) for v in value]
    return value


@cache
def decoder(tp: Any) -> Codec:
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        names, hints = _fields(tp)
        fields = [(name, decoder(hints[name])) for name in names]

        def instance(value: Any) -> Any:
            if not isinstance(value, list) or len(value) != len(fields):
                raise ValueError(f"{tp.__name__} expects {len(fields)} fields")
            return tp(**{name: field(v) for (name, field), v in zip(fields, value, strict=True)})

        return instance
    origin = typing.get_origin(tp)
    if origin is list:
        item_type = typing.get_args(tp)[0]
        item = decoder(item_type)
        allowed = _SCALARS.get(item_type)

        def items(value: Any) -> Any:
            if not isinstance(value, list):
                raise ValueError(f"expected a list, got {type(value).__name__}")
            if allowed is None:
                return [item(v) for v in value]
            for v in value:
                if not isinstance(v, allowed):
                    raise ValueError(f"expected {item_type.__name__}, got {type(v).__name__}")
            return value

        return items
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(inner) > 1:
            return _same
        one = decoder(inner[0])
        return lambda value: None if value is None else one(value)
    if tp in _SCALARS:
        allowed, name = _SCALARS[tp], tp.__name__

        def scalar(value: Any) -> Any:
            if not isinstance(value, allowed):
                raise ValueError(f"expected {name}, got {type(value).__name__}")
            return value

        return scalar
    return _same


@cache
def _fields(cls: type) -> tuple[tuple[str, ...], dict[str, Any]]:
    names = tuple(f.name for f in dataclasses.fields(cls))
    return names, typing.get_type_hints(cls)
