"""YAML mappings into frozen dataclasses: the typed core of the deployment config (config.py).

``build`` checks every key against the dataclass's fields and every value against its type
hint (nested dataclasses, optional values, mappings, tuples, scalars; an int where a float is
expected is taken), and names the dotted path of whatever is wrong.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config file or override that cannot describe a deployment."""


def require(ok: bool, message: str) -> None:
    """A config check: ValueError with the message (naming the dotted key) unless ok."""
    if not ok:
        raise ValueError(message)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    """Set ``raw[a][b][c] = value`` for ``key == "a.b.c"``, creating mappings on the way."""
    node = raw
    parts = key.split(".")
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{'.'.join(parts[: i + 1])} is not a mapping")
        node = child
    node[parts[-1]] = value


def expand(raw: dict[str, Any], key: str) -> list[str]:
    """The dotted keys ``key`` names: a ``*`` part stands for each key of the mapping there."""
    keys = [""]
    for part in key.split("."):
        if part != "*":
            keys = [f"{k}.{part}" if k else part for k in keys]
            continue
        keys = [f"{k}.{name}" for k in keys for name in _at(raw, k)]
    return keys


def is_set(raw: dict[str, Any], key: str) -> bool:
    """Whether the mappings hold ``key`` ("a.b.c")."""
    *parents, last = key.split(".")
    node = _at(raw, ".".join(parents)) if parents else raw
    return last in node


def _at(raw: dict[str, Any], key: str) -> dict[str, Any]:
    node: Any = raw
    for part in key.split(".") if key else []:
        node = node.get(part) if isinstance(node, dict) else None
    return node if isinstance(node, dict) else {}


def build(cls: type, raw: Any, path: str) -> Any:
    """Turn a YAML mapping into the dataclass ``cls``, checking names and types."""
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{path or 'config'} must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - names)
    if unknown:
        raise ConfigError(f"unknown key {_join(path, str(unknown[0]))} (known: {sorted(names)})")
    _check_set_elsewhere(cls, raw, path)
    values = {name: _coerce(hints[name], value, _join(path, name)) for name, value in raw.items()}
    try:
        return cls(**values)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"{path or 'config'}: {exc}") from exc


def _check_set_elsewhere(cls: type, raw: Mapping[str, Any], path: str) -> None:
    """A field's metadata "set_elsewhere" names keys of its mapping that the config fills in."""
    for f in dataclasses.fields(cls):
        value = raw.get(f.name)
        for key, source in f.metadata.get("set_elsewhere", {}).items():
            if isinstance(value, Mapping) and key in value:
                raise ConfigError(f"{_join(path, f.name)}.{key} cannot be set: it is {source}")


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return build(tp, {} if value is None else value, path)  # type: ignore[arg-type]
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        return _coerce(next(a for a in args if a is not type(None)), value, path)
    if origin is Mapping or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path} must be a mapping")
        return {str(k): _coerce(args[1], v, _join(path, str(k))) for k, v in value.items()}
    if origin is tuple:
        items = [] if value is None else value
        if not isinstance(items, list | tuple):
            raise ConfigError(f"{path} must be a list")
        return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(items))
    return _scalar(tp, value, path)


def _scalar(tp: Any, value: Any, path: str) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is str and isinstance(value, int | float) and not isinstance(value, bool):
        return str(value)
    if not isinstance(value, tp) or (tp is int and isinstance(value, bool)):
        raise ConfigError(f"{path} must be {tp.__name__}, got {value!r}")
    return value


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
