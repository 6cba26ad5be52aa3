"""Fuzzing a running server's endpoints from its own OpenAPI schema (/openapi.json) with
schemathesis: every operation of the schema (a new one fails the run until it is listed
here), positive cases (bodies the schema allows) and negative ones (bodies it does not), and
for the POST bodies hostile variants the schema cannot express: a lone surrogate (``\\ud800``)
appended to one of the body's strings, or one of its values replaced by 500-970 levels of
nested objects (the depth that broke chat templates); every answer checked for a 5xx.

The schema cannot say everything the request models check (a user message needs content, a
tool message its tool_call_id, token ids lie in the vocabulary), so most positive bodies
would stop at a 400; ``repair`` fixes those few things in positive bodies so that they reach
the tokenizer, the router and the workers. Every body names the served model, and asks for
at most 4 tokens (a generated ``max_tokens`` past that, or none, would make a CPU worker write
up to the whole context for each case). ``/admin/scale`` bodies name pools that do not exist,
so the run reaches the scaler without resizing the deployment it shares.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

OPERATIONS = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
    "GET /v1/models",
    "GET /health",
    "GET /metrics",
    "GET /admin/pools",
    "POST /admin/scale",
)
MODEL_BODIES = ("POST /v1/chat/completions", "POST /v1/completions")
HOSTILE = (None, "surrogate", "deep")
DEEP = "__deep__"
MAX_NEW_TOKENS = 4
VOCAB = 49152
"""SmolLM2's vocabulary: token ids of repaired prompts are taken modulo it."""


@dataclass
class FuzzReport:
    statuses: collections.Counter[int] = field(default_factory=collections.Counter)
    server_errors: list[str] = field(default_factory=list)
    """One line per 5xx answer: the operation, the status, the body sent, the answer."""

    @property
    def cases(self) -> int:
        return sum(self.statuses.values())


def fuzz(url: str, model: str, cases: int, derandomize: bool) -> FuzzReport:
    """``cases`` positive cases for each operation of OPERATIONS, and ``cases`` negative
    ones for each that takes a body."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    labels = {result.ok().label for result in schema.get_all_operations()}
    assert labels == set(OPERATIONS), f"operations not fuzzed: {labels - set(OPERATIONS)}"
    report = FuzzReport()
    for label in OPERATIONS:
        operation = schema.find_operation_by_label(label)
        assert operation is not None, f"{label} is not in the server's schema"
        for mode in schemathesis.GenerationMode:
            if mode == schemathesis.GenerationMode.NEGATIVE and not label.startswith("POST"):
                continue  # a GET without parameters has nothing to get wrong
            strategy = operation.as_strategy(generation_mode=mode)
            _run(url, model, strategy, mode, cases, derandomize, report)
    return report


def _run(
    url: str,
    model: str,
    strategy: Any,
    mode: schemathesis.GenerationMode,
    cases: int,
    derandomize: bool,
    report: FuzzReport,
) -> None:
    @given(
        case=strategy,
        hostile=st.sampled_from(HOSTILE),
        depth=st.integers(500, 970),
        where=st.integers(0, 2**16),
    )
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any, hostile: str | None, depth: int, where: int) -> None:
        label = case.operation.label
        if isinstance(case.body, dict):
            prepare(label, case.body, model, mode == schemathesis.GenerationMode.POSITIVE)
        if hostile is not None and isinstance(case.body, dict) and case.body:
            text = hostile_text(case.body, hostile, depth, where)
            headers = {"Content-Type": "application/json"}
            path = f"{url}{case.operation.path}"
            response: Any = httpx.post(path, content=text, headers=headers, timeout=120)
            sent: Any = text[:2000]
        else:
            response, sent = case.call(base_url=url, timeout=120), case.body
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append(f"{label} {response.status_code} {sent!r}: {response.text}")

    one()


def hostile_text(body: dict[str, Any], kind: str, depth: int, where: int) -> str:
    """The body as JSON text with a surrogate appended to its where-th string (modulo their
    number; the key itself when no value is one), or its where-th value nested ``depth``
    levels deep (built as text: Python's encoder stops near 1,000 levels)."""
    slots = list(_slots(body))
    container, key = slots[where % len(slots)]
    if kind == "surrogate":
        value = container[key]
        container[key] = (value if isinstance(value, str) else "") + "\ud800"
        return json.dumps(body)
    container[key] = DEEP
    half = depth // 2
    nested = '{"type": "object", "properties": {"x": ' * half + "{}" + "}}" * half
    return json.dumps(body).replace(json.dumps(DEEP), nested, 1)


def _slots(node: Any) -> Any:
    """(container, key) of every value inside node, depth first."""
    items = node.items() if isinstance(node, dict) else enumerate(node)
    for key, value in items:
        yield node, key
        if isinstance(value, dict | list):
            yield from _slots(value)


def prepare(label: str, body: dict[str, Any], model: str, positive: bool) -> None:
    if label == "POST /admin/scale":
        replicas = body.get("replicas")
        if isinstance(replicas, dict):
            body["replicas"] = {f"no-such-pool-{name}": n for name, n in replicas.items()}
        return
    body["model"] = model
    for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
        value = body.get(name)
        if value is None or (_number(value) and value > MAX_NEW_TOKENS):
            body[name] = MAX_NEW_TOKENS
    if _number(body.get("min_tokens")) and body["min_tokens"] > MAX_NEW_TOKENS:
        body["min_tokens"] = 0
    if positive:
        repair(body)


def repair(body: dict[str, Any]) -> None:
    """What the schema cannot say about a valid body, made so."""
    for message in body.get("messages") or []:
        if not isinstance(message, dict):
            continue
        if message.get("role") != "assistant":
            message.pop("tool_calls", None)
        if message.get("content") is None and not message.get("tool_calls"):
            message["content"] = "hi"
        if message.get("role") == "tool" and not message.get("tool_call_id"):
            message["tool_call_id"] = "call_1"
    prompt = body.get("prompt")
    if isinstance(prompt, list):
        body["prompt"] = [_in_vocab(p) for p in prompt]
    if prompt in ("", []) or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
        body["prompt"] = "hi"
    if type(body.get("n")) is int:
        body["n"] = min(body["n"], 2)


def _number(value: Any) -> bool:
    """An int or float (JSON 632.0 is a valid max_tokens), not a bool."""
    return isinstance(value, int | float) and not isinstance(value, bool)


def _in_vocab(item: Any) -> Any:
    if type(item) is int:
        return abs(item) % VOCAB
    if isinstance(item, list):
        return [abs(t) % VOCAB if type(t) is int else t for t in item]
    return item
