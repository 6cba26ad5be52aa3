"""POST /v1/chat/completions: the chat template runs here, in the API server."""

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
from splitserve.services.api.protocol import ChatCompletionRequest, ChatMessage
from splitserve.services.api.request_group import EngineRequestError, RequestGroup
from splitserve.services.api.vision_prompt import check_images, with_images
from splitserve.services.messages import TokenLogprob

router = APIRouter(dependencies=[Depends(check_api_key)])


def render_chat(tokenizer: Any, messages: list[ChatMessage]) -> list[int]:
    """Apply the model's chat template and tokenize, exactly as ``LLM.chat`` does."""
    conversation = [{"role": m.role, "content": m.template_content()} for m in messages]
    ids = tokenizer.apply_chat_template(
        conversation, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return list(ids)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = sv.get_state(request)
    sv.check_model(state, body.model)
    sv.check_n(state, body.n)
    urls = [url for m in body.messages for url in m.image_urls()]
    images = await check_images(state, urls)
    prompt = await asyncio.to_thread(render_chat, state.tokenizer, body.messages)
    prompt_images = None
    if images:
        prompt, prompt_images = with_images(state, prompt, images)
    params = sv.sampling_params(state, body, body.token_limit, len(prompt), body.num_logprobs)
    traffic = sv.traffic_class(state, request)
    group = sv.submit(state, [prompt], [params], body.n, traffic, prompt_images)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return sv.GroupStream(group, _stream(state, body, group, response_id, len(prompt)))
    choices = await sv.collect(request, group, body.n)
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": c.text},
                    "logprobs": _logprobs(state, c.logprobs, body) if body.logprobs else None,
                    "finish_reason": c.finish_reason,
                }
                for i, c in enumerate(choices)
            ],
            "usage": sv.usage([prompt], choices),
        }
    )


async def _stream(
    state: sv.ServerState,
    body: ChatCompletionRequest,
    group: RequestGroup,
    response_id: str,
    prompt_len: int,
) -> AsyncIterator[str]:
    created = int(time.time())
    usage_field = {"usage": None} if body.include_usage else {}

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        choice.update(extra)
        return sv.sse(
            {
                "id": response_id,
                "object": "chat.completion.chunk",
                "created": created,
                "model": state.model_name,
                "choices": [choice],
                **usage_field,
            }
        )

    completion_tokens = 0
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": ""})
        async for index, delta in group:
            completion_tokens += len(delta.token_ids)
            extra: dict[str, Any] = {}
            if body.logprobs and delta.logprobs:
                extra["logprobs"] = _logprobs(state, delta.logprobs, body)
            if delta.text or extra:
                yield chunk(index, {"content": delta.text}, **extra)
            if delta.finish_reason is not None:
                yield chunk(index, {}, finish_reason=delta.finish_reason)
        if body.include_usage:
            counts = sv.usage_counts(prompt_len, completion_tokens)
            yield sv.usage_chunk(
                response_id, "chat.completion.chunk", created, state.model_name, counts
            )
    except EngineRequestError as exc:
        yield sv.sse_error(exc)
    finally:
        group.close()
    yield sv.SSE_DONE


def _logprobs(
    state: sv.ServerState, positions: list[list[TokenLogprob]], body: ChatCompletionRequest
) -> dict[str, Any]:
    def entry(e: TokenLogprob) -> dict[str, Any]:
        text = sv.token_text(state, e)
        return {"token": text, "logprob": e.logprob, "bytes": list(text.encode())}

    content = []
    for position in positions:
        item = entry(position[0])
        item["top_logprobs"] = [entry(e) for e in sv.top_entries(position, body.top_logprobs or 0)]
        content.append(item)
    return {"content": content}
