"""Structured-output constraints turned into xgrammar grammars, checked before they run.

``parse`` is the check the API server runs on every constrained request (no tokenizer
needed): the constraint's size, a JSON schema's validity and the keywords xgrammar would
silently ignore, regex and EBNF syntax. ``GrammarCompiler`` compiles a constraint against a
tokenizer's vocabulary (cached by content, bounded in time) into what a request's matcher
runs (engine/structured/matcher.py).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from typing import Any

import xgrammar as xgr

from splitserve.engine.loader import NumericTokenizer
from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.engine.tokenizer_json import full_tokenizer

MAX_SOURCE_BYTES = 64 << 10
"""The largest schema, regex, grammar or list of choices accepted (as text)."""
MAX_GRAMMAR_BYTES = 1 << 20
"""The largest grammar a constraint may expand to (xgrammar's EBNF of it)."""
COMPILE_TIMEOUT_S = 10.0
"""The longest a constraint may take to compile against the vocabulary."""
CACHE_SIZE = 256

UNSUPPORTED_KEYWORDS = (
    "not",
    "if",
    "then",
    "else",
    "contains",
    "minContains",
    "maxContains",
    "uniqueItems",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "unevaluatedProperties",
    "unevaluatedItems",
)
"""JSON-schema keywords xgrammar accepts but does not enforce: refused, so that an output
never claims to follow a schema it was not held to."""

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")


class GrammarError(ValueError):
    """A constraint that cannot be used; the message says why (a 400 to the client)."""


def source(spec: StructuredOutputsParams) -> tuple[str, str]:
    """(kind, text): the constraint in a canonical text form, the key of compiled grammars."""
    kind = spec.kind
    if kind == "json":
        schema = spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError(f"the JSON schema is not valid JSON: {exc}") from None
        # Key order kept: a schema's property order is the order the output writes them.
        return kind, json.dumps(schema, separators=(",", ":"))
    if kind == "json_object":
        return kind, ""
    if kind == "choice":
        assert spec.choice is not None
        return "grammar", "root ::= " + " | ".join(json.dumps(c) for c in spec.choice)
    text = spec.regex if kind == "regex" else spec.grammar
    assert text is not None
    return kind, text


def parse(spec: StructuredOutputsParams) -> xgr.Grammar:
    """The constraint's grammar; GrammarError naming what is wrong with it."""
    kind, text = source(spec)
    if len(text.encode()) > MAX_SOURCE_BYTES:
        raise GrammarError(
            f"the {_NAMES[spec.kind]} is {len(text.encode())} bytes, over the limit of "
            f"{MAX_SOURCE_BYTES}"
        )
    if kind == "json":
        _check_schema(json.loads(text))
    try:
        grammar = _convert(kind, text)
    except RuntimeError as exc:
        raise GrammarError(f"invalid {_NAMES[spec.kind]}: {_reason(exc)}") from None
    if len(str(grammar)) > MAX_GRAMMAR_BYTES:
        raise GrammarError(
            f"the {_NAMES[spec.kind]} expands to a grammar over {MAX_GRAMMAR_BYTES} bytes"
        )
    return grammar


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
}


def _convert(kind: str, text: str) -> xgr.Grammar:
    if kind == "json":
        return xgr.Grammar.from_json_schema(text, any_whitespace=False)
    if kind == "json_object":  # an object (xgrammar's builtin JSON grammar takes any value)
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return xgr.Grammar.from_regex(text)
    return xgr.Grammar.from_ebnf(text)


def _reason(exc: Exception) -> str:
    """xgrammar's message without its timestamp and source location."""
    lines = [_LOCATION.sub("", line).strip() for line in str(exc).splitlines()]
    return "; ".join(line for line in lines if line and not line.startswith("Warning"))


def _check_schema(schema: Any) -> None:
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    if not isinstance(schema, dict | bool):
        raise GrammarError("the JSON schema must be an object")
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise GrammarError(f"invalid JSON schema: {exc.message} (at {exc.json_path})") from None
    _check_keywords(schema, "#")


def _check_keywords(node: Any, path: str) -> None:
    if isinstance(node, list):
        for index, item in enumerate(node):
            _check_keywords(item, f"{path}/{index}")
        return
    if not isinstance(node, dict):
        return
    for key in UNSUPPORTED_KEYWORDS:
        if key in node:
            raise GrammarError(f"unsupported JSON schema keyword {key!r} at {path}")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise GrammarError(f"unsupported JSON schema $ref {ref!r} at {path} (only local ones)")
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        raise GrammarError(f"unsupported JSON schema 'allOf' of several schemas at {path}")
    for key, value in node.items():
        if key in ("properties", "$defs", "definitions", "patternProperties"):
            if isinstance(value, dict):
                for name, child in value.items():
                    _check_keywords(child, f"{path}/{key}/{name}")
        elif key not in ("enum", "const", "default", "examples"):
            _check_keywords(value, f"{path}/{key}")


class GrammarCompiler:
    """Compiles constraints against one tokenizer's vocabulary; the last CACHE_SIZE compiled
    grammars are kept by their canonical text. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        """tokenizer: a Hugging Face tokenizer, a worker's JsonTokenizer (its Hugging Face one
        is loaded) or a random shape's NumericTokenizer (whose token i is the text " i")."""
        tokenizer = full_tokenizer(tokenizer)
        if isinstance(tokenizer, NumericTokenizer):
            words = [f" {i}" for i in range(vocab_size)]
            info = xgr.TokenizerInfo(words, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        else:
            info = xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
            )
        self._start(info)

    @classmethod
    def from_vocabulary(cls, tokens: list[bytes], stop_token_ids: list[int]) -> GrammarCompiler:
        """A compiler for a vocabulary given as each token's bytes (a synthetic vocabulary
        for a random shape, in benchmarks)."""
        compiler = cls.__new__(cls)
        compiler._start(xgr.TokenizerInfo(tokens, stop_token_ids=stop_token_ids))
        return compiler

    def _start(self, info: xgr.TokenizerInfo) -> None:
        self.vocab_size = info.vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()

    def compile(
        self, spec: StructuredOutputsParams, timeout_s: float = COMPILE_TIMEOUT_S
    ) -> xgr.CompiledGrammar:
        """The compiled grammar (from the cache when seen before); GrammarError if the
        constraint is invalid or takes longer than timeout_s to compile."""
        key = source(spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        grammar = parse(spec)
        compiled = self._compile_bounded(grammar, spec.kind, timeout_s)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def _compile_bounded(
        self, grammar: xgr.Grammar, kind: str, timeout_s: float
    ) -> xgr.CompiledGrammar:
        """Compile on a thread of its own and wait at most timeout_s: a constraint that runs
        over is refused and its thread left to finish (xgrammar cannot be interrupted), and
        the compiles after it do not queue behind it."""
        done: dict[str, Any] = {}

        def run() -> None:
            try:
                done["grammar"] = self._compiler.compile_grammar(grammar)
            except RuntimeError as exc:
                done["error"] = exc
            finally:
                with _RUNNING_LOCK:
                    _RUNNING.discard(thread)

        thread = threading.Thread(target=run, name="grammar-compile", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.add(thread)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            raise GrammarError(f"the {_NAMES[kind]} took longer than {timeout_s:g} s to compile")
        if "error" in done:
            raise GrammarError(f"invalid {_NAMES[kind]}: {_reason(done['error'])}")
        return done["grammar"]


_RUNNING: set[threading.Thread] = set()
_RUNNING_LOCK = threading.Lock()


def settle_compiles(timeout_s: float) -> int:
    """Wait at most timeout_s for the compiles still running (those refused for time go on in
    their threads); the number left. A process must not exit normally while one is: at
    interpreter shutdown the thread is unwound out of xgrammar's native code, which aborts
    the process (SIGABRT), so the caller leaves with ``os._exit`` instead."""
    deadline = time.monotonic() + timeout_s
    while True:
        with _RUNNING_LOCK:
            running = list(_RUNNING)
        if not running:
            return 0
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return len(running)
        running[0].join(remaining)
