"""Core types of the engine: the request being served and its output."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.vision.multimodal import ImageInput

if TYPE_CHECKING:
    from splitserve.engine.structured.matcher import RequestGrammar


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
        self.draft_token_ids: list[int] = []
        """Speculative tokens to verify in this step after the last token (engine/spec/);
        never part of the sequence until accepted."""
        self.num_cached_tokens = 0
        self.admitted = False
        self.prefill_only = False
        self.traffic_class: str | None = None
        self.block_table: list[int] = []
        self.num_committed_blocks = 0
        self.window_tables: list[list[int]] = []
        """The block table of each sliding-window KV cache group (engine/hybrid_blocks.py)."""
        self.cached_until = 0
        """Positions below it have group-0 KV from the prefix cache: replaying them (a hit
        on a model with window groups) writes no group-0 KV."""
        self.window_from = 0
        """The first position the window groups hold KV for (block-aligned)."""
        self.arrival_time = time.monotonic()
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.output_text = ""
        self.num_resumed = 0
        """The prompt's last tokens that are output of an earlier run (engine/resume.py)."""
        self.resumed_chars = 0
        """Of that earlier output's text, the characters its client already has."""
        self.grammar: RequestGrammar | None = None
        """The matcher of params.structured_outputs (engine/structured/), set by the engine."""

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


def decodes(req: Request, num_new: int) -> bool:
    """A step of ``num_new`` tokens computes the request's last token and its drafts (if any),
    nothing else: decode rows, one per position (engine/cuda_graphs.py, model_runner.py)."""
    return num_new == 1 + len(req.draft_token_ids) and req.num_computed_tokens + 1 == req.num_tokens
