"""Core types of the engine: sampling parameters, the request being served, and its output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from splitserve.engine.vision.multimodal import ImageInput


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop, per request (the fields vLLM users know).

    top_k <= 0 disables top-k; max_tokens=None means "until the context is full";
    logprobs=N returns the sampled token's logprob plus the top N (0 = sampled token only).
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
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop if s]
        self.stop_token_ids = list(self.stop_token_ids)
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


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One generated sequence. text and token_ids are cumulative, never deltas."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0


class Request:
    """A sequence inside the engine: prompt + generated tokens, and how much of it has KV.

    The scheduler advances num_computed_tokens; the block manager owns block_table. After a
    preemption num_computed_tokens returns to 0 and the whole sequence is recomputed.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        eos_token_ids: tuple[int, ...] = (),
        images: list[ImageInput] | None = None,
    ) -> None:
        self.request_id = request_id
        self.images = images or []
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self._all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.output_token_ids: list[int] = []
        self.output_logprobs: list[dict[int, Logprob]] = []
        self.cumulative_logprob = 0.0
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_pending = 0
        """Tokens sampled on the device that the host has not read yet (engine/overlap.py)."""
        self.num_cached_tokens = 0
        self.admitted = False
        self.prefill_only = False
        self.traffic_class: str | None = None
        self.block_table: list[int] = []
        self.num_committed_blocks = 0
        self.arrival_time = time.monotonic()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_text = ""
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens the host knows (not the pending ones); one list extended
        in place (outputs only ever grow)."""
        missing = len(self.prompt_token_ids) + len(self.output_token_ids) - len(self._all_token_ids)
        if missing:
            self._all_token_ids.extend(self.output_token_ids[-missing:])
        return self._all_token_ids

    @property
    def num_tokens(self) -> int:
        """The sequence's length as the scheduler sees it, pending tokens included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def finish(self, reason: str, stop_reason: str | int | None = None) -> None:
        self.status = RequestStatus.FINISHED
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def to_output(self) -> RequestOutput:
        completion = CompletionOutput(
            index=0,
            text=self.output_text,
            token_ids=list(self.output_token_ids),
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            logprobs=list(self.output_logprobs) if self.params.logprobs is not None else None,
            cumulative_logprob=self.cumulative_logprob
            if self.params.logprobs is not None
            else None,
        )
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=self.is_finished,
            num_cached_tokens=self.num_cached_tokens,
        )
