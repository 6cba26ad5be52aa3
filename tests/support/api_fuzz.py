"""Fuzzing a running server's endpoints (chat, completions, Responses, Messages and its token
count) from its own OpenAPI schema (/openapi.json) with schemathesis: positive cases (bodies
the schema allows) and negative ones (bodies it does not), every answer checked for a 5xx.

The schema cannot say everything the request models check (a user message needs content, a
tool message its tool_call_id, token ids lie in the vocabulary), so most positive bodies
would stop at a 400; ``repair`` fixes those few things in positive bodies so that they reach
the tokenizer, the router and the workers. Every body names the served model, and asks for
at most 4 tokens (a generated ``max_tokens`` past that, or none, would make a CPU worker write
up to the whole context for each case).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings

OPERATIONS = (
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "POST /v1/messages",
    "POST /v1/messages/count_tokens",
)
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
    """``cases`` positive and ``cases`` negative cases for each operation of OPERATIONS."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    report = FuzzReport()
    for label in OPERATIONS:
        operation = schema.find_operation_by_label(label)
        assert operation is not None, f"{label} is not in the server's schema"
        for mode in schemathesis.GenerationMode:
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
    @given(case=strategy)
    @settings(
        max_examples=cases,
        deadline=None,
        database=None,
        derandomize=derandomize,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: Any) -> None:
        if isinstance(case.body, dict):
            prepare(case.body, model, mode == schemathesis.GenerationMode.POSITIVE)
        response = case.call(base_url=url, timeout=120)
        report.statuses[response.status_code] += 1
        if response.status_code >= 500:
            report.server_errors.append(
                f"{case.operation.label} {response.status_code} {case.body!r}: {response.text}"
            )

    one()


def prepare(body: dict[str, Any], model: str, positive: bool) -> None:
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
