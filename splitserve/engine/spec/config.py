"""Speculative decoding settings: one frozen dataclass, spelled as vLLM's speculative_config."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "draft_model", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """method: ``ngram`` (prompt lookup, no extra model), ``draft_model`` (``model``: a
    smaller model with the target's tokenizer, run beside it with its own paged KV) or
    ``mtp`` (the target checkpoint's multi-token-prediction layer, DeepSeek-V3's or V4's,
    chained for more than one draft; engine/spec/mtp.py).

    num_speculative_tokens: the most draft tokens verified per request and step.
    prompt_lookup_min / _max: n-gram lengths tried, longest first (ngram only).
    dynamic: choose each step how many tokens to verify per request from measured acceptance
    and step times (engine/spec/dynamic.py); False always proposes up to the maximum.
    draft_kv_cache_bytes: the draft model's (or MTP layer's) KV pool.
    draft_seed: the seed of a random-weight draft (``shape:`` model); None: the target's, so
    a draft of the target's shape is the target (every draft accepted), another seed gives a
    draft that is almost never accepted (benchmarks of the overhead).
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    model: str | None = None
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    dynamic: bool = True
    draft_kv_cache_bytes: int = 64 << 20
    draft_seed: int | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative method {self.method!r} is not one of {METHODS}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be in [1, 16]")
        if self.method == "draft_model" and not self.model:
            raise ValueError("the draft_model method needs `model`: the draft model")
        if self.method != "draft_model" and self.model:
            raise ValueError("`model` is only for the draft_model method")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.draft_kv_cache_bytes < 1:
            raise ValueError("draft_kv_cache_bytes must be positive")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """vLLM's speculative_config dict; an unknown key is a ValueError naming it."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(
                f"unknown speculative_config key {unknown[0]!r} (known: {sorted(known)})"
            )
        return cls(**values)
