"""POST /v1/completions: prompts as text, lists of text, or token ids."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from splitserve.services.api import serving as sv
from splitserve.services.api.auth import check_api_key
from splitserve.services.api.errors import APIError
from splitserve.services.api.json_body import CheckedRoute
from splitserve.services.api.protocol import CompletionRequest
from splitserve.services.api.request_group import RequestGroup
from splitserve.services.messages import TokenLogprob

router = APIRouter(dependencies=[Depends(check_api_key)], route_class=CheckedRoute)
DEFAULT_MAX_TOKENS = 16


def tokenize_prompts(tokenizer: Any, prompt: Any) -> list[list[int]]:
    """Normalise the four prompt forms to a list of token id lists."""
    if isinstance(prompt, str):
        return [list(tokenizer.encode(prompt))]
    if all(isinstance(p, str) for p in prompt):
        return [list(tokenizer.encode(p)) for p in prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [list(p) for p in prompt]


def _check_token_ids(state: sv.ServerState, prompts: list[list[int]]) -> None:
    vocab = len(state.tokenizer)
    for ids in prompts:
        if any(not 0 <= t < vocab for t in ids):
            raise APIError(
                400,
                f"prompt: token ids must be in [0, {vocab})",
                param="prompt",
                code="invalid_value",
            )


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    state = sv.get_state(request)
    sv.check_model(state, body.model)
    sv.check_n(state, body.n, body.num_prompts)
    if body.echo and body.logprobs is not None:
        raise APIError(400, "echo with logprobs is not supported", param="echo")
    spec, param = body.constraint()
    if spec is not None:
        await state.constraints.check(spec, param)
    try:
        prompts = await asyncio.to_thread(tokenize_prompts, state.tokenizer, body.prompt)
    except ValueError as exc:  # text the model's tokenizer cannot read (a shape model's)
        raise APIError(400, f"prompt: {exc}", param="prompt", code="invalid_value") from None
    _check_token_ids(state, prompts)
    limit = body.max_tokens
    params = [
        sv.sampling_params(
            state,
            body,
            limit if limit is not None else min(DEFAULT_MAX_TOKENS, state.max_model_len - len(p)),
            len(p),
            body.logprobs,
            spec,
        )
        for p in prompts
    ]
    echoes = await asyncio.to_thread(_echo_texts, state, body, prompts)
    traffic = sv.traffic_class(state, request)
    group = await sv.submit(state, request, prompts, params, body.n, traffic)
    response_id = f"cmpl-{uuid.uuid4().hex}"
    if body.stream:
        return sv.GroupStream(group, _stream(state, body, group, response_id, prompts, echoes))
    choices = await sv.collect(request, group, len(prompts) * body.n)
    return JSONResponse(
        {
            "id": response_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [
                {
                    "index": i,
                    "text": echoes[i // body.n] + c.text,
                    "logprobs": _logprobs(state, c.logprobs, body.logprobs, 0),
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": sv.usage(prompts, choices),
        }
    )


def _echo_texts(state: sv.ServerState, body: CompletionRequest, prompts: list[list[int]]) -> list:
    if not body.echo:
        return [""] * len(prompts)
    if isinstance(body.prompt, str):
        return [body.prompt]
    if all(isinstance(p, str) for p in body.prompt):
        return list(body.prompt)
    return [str(state.tokenizer.decode(p)) for p in prompts]


async def _stream(
    state: sv.ServerState,
    body: CompletionRequest,
    group: RequestGroup,
    response_id: str,
    prompts: list[list[int]],
    echoes: list[str],
) -> AsyncIterator[str]:
    created = int(time.time())
    usage_field = {"usage": None} if body.include_usage else {}
    offsets = [len(echoes[i // body.n]) for i in range(len(prompts) * body.n)]

    def chunk(index: int, text: str, logprobs: Any, finish_reason: str | None) -> str:
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
        return sv.sse(
            {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
                **usage_field,
            }
        )

    completion_tokens = 0
    try:
        for i in range(len(offsets)):
            if echoes[i // body.n]:
                yield chunk(i, echoes[i // body.n], None, None)
        async for index, delta in group:
            completion_tokens += len(delta.token_ids)
            logprobs = _logprobs(state, delta.logprobs or [], body.logprobs, offsets[index])
            offsets[index] += len(delta.text)
            if delta.text or delta.finish_reason is not None or delta.logprobs:
                yield chunk(index, delta.text, logprobs, delta.finish_reason)
        if body.include_usage:
            prompt_tokens = sum(len(p) for p in prompts)
            counts = sv.usage_counts(prompt_tokens, completion_tokens)
            yield sv.usage_chunk(response_id, "text_completion", created, state.model_name, counts)
    finally:
        group.close()


def _logprobs(
    state: sv.ServerState, positions: list[list[TokenLogprob]], top: int | None, offset: int
) -> dict[str, Any] | None:
    """The legacy completions format: parallel lists, top alternatives as {token: logprob}."""
    if top is None:
        return None
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for position in positions:
        text = sv.token_text(state, position[0])
        tokens.append(text)
        token_logprobs.append(sv.json_logprob(position[0]))
        top_logprobs.append(
            {sv.token_text(state, e): sv.json_logprob(e) for e in sv.top_entries(position, top)}
        )
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
