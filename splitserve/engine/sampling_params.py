"""Per-request sampling parameters: how to pick tokens and when to stop.

No torch import here: the API server and the message codec build and parse these without
loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class StructuredOutputsParams:
    """A constraint on the generated text, exactly one of (vLLM's ``structured_outputs``):

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object;
    regex: a regular expression the whole output matches; choice: one of these strings;
    grammar: an EBNF grammar as xgrammar reads it (GBNF, ``root ::= ...``).
    The output matches from its first token; decoding stops when the constraint is complete.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        _check(
            len(given) == 1,
            "structured_outputs needs exactly one of json, json_object, regex, choice, grammar"
            + (f" (got {', '.join(given)})" if given else ""),
        )
        if self.choice is not None:
            _check(
                bool(self.choice) and all(isinstance(c, str) and c for c in self.choice),
                "structured_outputs.choice must be a non-empty list of non-empty strings",
            )
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(name for name in KINDS if getattr(self, name) not in (None, False))


KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request (the fields vLLM users know).

    top_k <= 0 disables top-k; max_tokens=None means "until the context is full";
    logprobs=N returns the sampled token's logprob plus the top N (0 = sampled token only).
    kept_special_token_ids: special tokens written into the text although
    skip_special_tokens drops the others (the marks an output format is read by, such as
    Mistral's ``[TOOL_CALLS]``: services/api/output.py).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    kept_special_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
        self.kept_special_token_ids = list(self.kept_special_token_ids)
        _check(self.n >= 1, "n must be at least 1")
        _check(0.0 <= self.temperature <= 2.0, "temperature must be in [0, 2]")
        _check(0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]")
        _check(0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty must be positive")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1")
        _check(self.min_tokens >= 0, "min_tokens must be non-negative")
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            "min_tokens must not exceed max_tokens",
        )
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
