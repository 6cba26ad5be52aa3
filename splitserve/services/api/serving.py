"""What chat and completions share: server state, checks, fan-out of `n`, collecting output."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from splitserve.config import DeployConfig
from splitserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from splitserve.engine.vision.config import VisionConfig
from splitserve.router.router import NoWorkerError
from splitserve.services.api.client_share import RETRY_AFTER_S, ClientShares, client_of
from splitserve.services.api.constraints import ConstraintCheck
from splitserve.services.api.errors import MAX_LOGGED_CHARS, APIError, error_body, logger
from splitserve.services.api.exchange import RequestExchange
from splitserve.services.api.images import PromptImages
from splitserve.services.api.output import OutputFormat
from splitserve.services.api.protocol import SamplingFields
from splitserve.services.api.request_group import EngineRequestError, QueueFullError, RequestGroup
from splitserve.services.messages import TokenDelta, TokenLogprob
from splitserve.services.metrics import API_POOL, Metrics

DISCONNECT_POLL_S = 0.25


@dataclass
class ServerState:
    config: DeployConfig
    tokenizer: Any
    exchange: RequestExchange
    metrics: Metrics
    max_model_len: int
    vision: VisionConfig | None = None
    """The model's image side (None: a text-only model)."""
    constraints: ConstraintCheck = field(init=False)
    """Checks structured-output constraints before they reach a worker."""
    shares: ClientShares = field(init=False)
    """What each client holds of the admission bound."""
    output: OutputFormat = field(init=False)
    """How the model writes reasoning and tool calls."""

    def __post_init__(self) -> None:
        server = self.config.server
        self.constraints = ConstraintCheck(self.tokenizer, server.grammar_timeout_s)
        self.shares = ClientShares(server.max_queue, server.client_share)
        self.output = OutputFormat.of(server, self.tokenizer)

    @property
    def model_name(self) -> str:
        return self.config.server.served_model_name or self.config.model


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def check_model(state: ServerState, model: str) -> None:
    if model != state.model_name:
        raise APIError(
            404,
            f"The model `{model}` does not exist.",
            param="model",
            code="model_not_found",
        )


def check_n(state: ServerState, n: int, prompts: int = 1) -> None:
    """400 past server.max_n, or for more engine requests (prompts x n) than one client may
    hold at once (such a request could never be admitted)."""
    server = state.config.server
    if n > server.max_n:
        raise APIError(400, f"n: must be at most {server.max_n}", param="n", code="invalid_value")
    limit = state.shares.limit
    if prompts * n > limit:
        param = "n" if prompts == 1 else "prompt"
        share = "" if limit == server.max_queue else " for one client (server.client_share)"
        raise APIError(
            400,
            f"{param}: {prompts} prompt(s) x n={n} make {prompts * n} engine requests, more "
            f"than the {limit} this server admits at once{share}",
            param=param,
            code="invalid_value",
        )


def sampling_params(
    state: ServerState,
    body: SamplingFields,
    limit: int | None,
    prompt_len: int,
    logprobs: int | None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """The engine's parameters for one choice; 400 when the prompt and limit do not fit.
    structured_outputs: a constraint ``state.constraints`` has checked."""
    room = state.max_model_len - prompt_len
    max_tokens = limit if limit is not None else room
    if max_tokens > room or room < 1:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens. However, "
            f"you requested {prompt_len + max_tokens} tokens ({prompt_len} in the prompt, "
            f"{max_tokens} in the completion).",
            param="max_tokens",
            code="context_length_exceeded",
        )
    try:
        return SamplingParams(
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            seed=body.seed,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repetition_penalty,
            min_tokens=body.min_tokens,
            ignore_eos=body.ignore_eos,
            stop=body.stop_list(),
            stop_token_ids=_stop_token_ids(state, body),
            max_tokens=max_tokens,
            logprobs=logprobs,
            structured_outputs=structured_outputs,
        )
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_value") from exc


def _stop_token_ids(state: ServerState, body: SamplingFields) -> list[int]:
    """The body's stop_token_ids; 400 for one outside the vocabulary."""
    ids = body.stop_token_ids or []
    vocab = len(state.tokenizer)
    if any(t >= vocab for t in ids):
        raise APIError(
            400,
            f"stop_token_ids: token ids must be in [0, {vocab})",
            param="stop_token_ids",
            code="invalid_value",
        )
    return list(ids)


TRAFFIC_CLASS_HEADER = "x-traffic-class"


def traffic_class(state: ServerState, request: Request) -> str:
    """The request's retention class: its x-traffic-class header or kv_store.default_class."""
    store = state.config.kv_store
    name = request.headers.get(TRAFFIC_CLASS_HEADER, store.default_class)
    if name not in store.retention:
        known = ", ".join(sorted(store.retention))
        raise APIError(
            400,
            f"{TRAFFIC_CLASS_HEADER}: unknown traffic class {name!r} (known: {known})",
            param=TRAFFIC_CLASS_HEADER,
            code="invalid_value",
        )
    return name


async def submit(
    state: ServerState,
    request: Request,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    n: int,
    traffic: str | None = None,
    images: PromptImages | None = None,
) -> RequestGroup:
    """Fan out prompts x n choices (choice index = prompt * n + i; seed + i per choice),
    held against the client's share until the group closes."""
    base = uuid.uuid4().hex
    requests = []
    for p, (prompt_ids, prompt_params) in enumerate(zip(prompts, params, strict=True)):
        for i in range(n):
            seed = None if prompt_params.seed is None else prompt_params.seed + i
            choice_params = SamplingParams(**{**prompt_params.__dict__, "seed": seed})
            requests.append((f"{base}-{p * n + i}", prompt_ids, choice_params))
    client = client_of(request, bool(state.config.server.api_keys))
    state.shares.take(client, len(requests))
    try:
        group = await _admit(state, requests, traffic, images)
    except BaseException:
        state.shares.give_back(client, len(requests))
        raise
    group.on_close = lambda: state.shares.give_back(client, len(requests))
    return group


async def _admit(
    state: ServerState,
    requests: list[tuple[str, list[int], SamplingParams]],
    traffic: str | None,
    images: PromptImages | None,
) -> RequestGroup:
    """The exchange's admission, its refusals as API errors."""
    try:
        return await state.exchange.admit(requests, traffic, images)
    except NoWorkerError as exc:
        raise APIError(503, str(exc), "server_error", code="no_worker") from exc
    except QueueFullError as exc:
        api = state.metrics.labels(API_POOL, "api")
        state.metrics.request_failure.labels(*api, "queue_full").inc()
        raise APIError(
            503,
            str(exc),
            "server_overloaded",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        ) from exc


@dataclass
class Choice:
    """One choice's output, accumulated from deltas."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[list[TokenLogprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    """The stop string or stop token that ended the choice."""
    num_cached_tokens: int = 0

    def add(self, delta: TokenDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.finish_reason = delta.finish_reason
        self.stop_reason = delta.stop_reason
        self.num_cached_tokens = delta.num_cached_tokens


async def collect(request: Request, group: RequestGroup, num_choices: int) -> list[Choice]:
    """Wait for every choice to finish; aborts the group if the client goes away."""
    choices = [Choice() for _ in range(num_choices)]

    async def drain() -> None:
        async for index, delta in group:
            choices[index].add(delta)

    task = asyncio.ensure_future(drain())
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if not task.done() and await request.is_disconnected():
                task.cancel()
                raise APIError(499, "client disconnected", code="client_disconnected")
        task.result()
    except EngineRequestError as exc:
        raise error_of(exc) from exc
    finally:
        group.close()
    return choices


def usage(prompts: Sequence[list[int]], choices: Sequence[Choice]) -> dict[str, Any]:
    """OpenAI usage: each prompt counted once, every choice's tokens counted."""
    return usage_counts(sum(len(p) for p in prompts), sum(len(c.token_ids) for c in choices))


def usage_counts(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def usage_chunk(
    response_id: str, kind: str, created: int, model: str, counts: dict[str, int]
) -> str:
    """The last streamed chunk when stream_options.include_usage is set: usage, no choices."""
    return sse(
        {
            "id": response_id,
            "object": kind,
            "created": created,
            "model": model,
            "choices": [],
            "usage": counts,
        }
    )


def token_text(state: ServerState, entry: TokenLogprob) -> str:
    if entry.decoded_token is not None:
        return entry.decoded_token
    return str(state.tokenizer.decode([entry.token_id]))


LOWEST_LOGPROB = -9999.0
"""What a logprob of -inf (a token a structured-output grammar masked) is reported as: JSON has
no infinity (a response holding one failed with a 500, a stream sent invalid JSON), and
-9999.0 is what vLLM reports."""


def json_logprob(entry: TokenLogprob) -> float:
    """The entry's logprob as JSON can carry it: finite, at least LOWEST_LOGPROB."""
    value = entry.logprob
    return value if value > LOWEST_LOGPROB else LOWEST_LOGPROB


def top_entries(position: list[TokenLogprob], n: int) -> list[TokenLogprob]:
    """The n most likely tokens at a position (the sampled token may or may not be among them)."""
    return sorted(position, key=lambda e: e.rank)[:n]


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


def error_of(exc: EngineRequestError) -> APIError:
    """The API error for a request a worker refused (400) or the service failed (503)."""
    if exc.status == 400:
        return APIError(400, str(exc), code="invalid_value")
    return APIError(exc.status, str(exc), "server_error", code="request_failed")


SSE_DONE = "data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True)
class StreamStyle:
    """How an API ends a stream: the event that reports an error, and the closing line."""

    error: Callable[[APIError], str]
    done: str


OPENAI_STREAM = StreamStyle(lambda e: sse(error_body(e.message, e.type, e.param, e.code)), SSE_DONE)
INTERNAL_ERROR = APIError(500, "internal server error", "server_error")


async def ended(
    content: AsyncIterator[str], style: StreamStyle = OPENAI_STREAM
) -> AsyncIterator[bytes]:
    """The events of a stream, encoded here, then the style's closing line (OpenAI's
    ``[DONE]``): whatever fails on the way (a worker's error, the output's handling, an event
    that does not encode) ends the stream with an error event first, logged in one line."""
    try:
        async for event in content:
            yield event.encode()
    except EngineRequestError as exc:
        yield style.error(error_of(exc)).encode()
    except Exception as exc:  # the stream must still end with an error event and [DONE]
        logger.error("a stream failed: %s", repr(exc)[:MAX_LOGGED_CHARS])
        yield style.error(INTERNAL_ERROR).encode()
    yield style.done.encode()


class GroupStream(StreamingResponse):
    """The SSE response of a request group (``ended``), which it closes however the
    response ends.

    NOTE: the stream's own ``finally`` is not enough: an async generator that never started
    (the client left before the first byte) runs none of its code when it is dropped."""

    def __init__(
        self,
        group: RequestGroup,
        content: AsyncIterator[str],
        style: StreamStyle = OPENAI_STREAM,
    ) -> None:
        stream = ended(content, style)
        super().__init__(stream, media_type="text/event-stream", headers=SSE_HEADERS)
        self.group = group

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()
