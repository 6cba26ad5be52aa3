"""POST /v1/chat/completions: the chat template runs here, in the API server; tool calls are
read out of the output here too (tools.py, tool_calls.py)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from jinja2 import TemplateError
from pydantic import ValidationError

from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.services.api import serving as sv
from splitserve.services.api.auth import check_api_key
from splitserve.services.api.errors import MAX_LOGGED_CHARS, APIError
from splitserve.services.api.images import PromptImages
from splitserve.services.api.json_body import CheckedRoute
from splitserve.services.api.output import (
    Block,
    Blocks,
    ChoiceReader,
    OutputEvent,
    OutputFormat,
    Step,
)
from splitserve.services.api.protocol import ChatCompletionRequest, ChatMessage
from splitserve.services.api.reasoning import Reasoning
from splitserve.services.api.request_group import RequestGroup
from splitserve.services.api.tool_calls import stream_delta
from splitserve.services.api.tools import ToolPlan
from splitserve.services.api.vision_prompt import check_images, with_images
from splitserve.services.messages import TokenLogprob

router = APIRouter(dependencies=[Depends(check_api_key)], route_class=CheckedRoute)


PROMPT_TAIL_TOKENS = 8
"""Of the rendered prompt, the last tokens read for an open ``<think>`` (reasoning.py)."""


def render_chat(
    tokenizer: Any,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Apply the model's chat template and tokenize, exactly as ``LLM.chat`` does; the tools
    go to the template, which renders them if it knows how, and so do the request's
    chat_template_kwargs (``enable_thinking`` and the like)."""
    conversation = [m.template_message() for m in messages]
    ids = tokenizer.apply_chat_template(
        conversation,
        tools=tools,
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **(template_kwargs or {}),
    )
    return list(ids)


async def constraint(
    state: sv.ServerState, body: ChatCompletionRequest, tools: ToolPlan
) -> StructuredOutputsParams | None:
    """The request's constraint (response_format, structured_outputs, or tool_choice required
    or named), checked; every tool's parameters are checked as schemas first (400s)."""
    await state.constraints.check_schemas(
        [
            (f"tools.{i}.function.parameters", tool.function.arguments_schema)
            for i, tool in enumerate(body.tools or [])
        ]
    )
    spec, param = (tools.constraint(), "tool_choice") if tools.forced else body.constraint()
    if spec is not None:
        await state.constraints.check(spec, param)
    return spec


def conversation(body: dict[str, Any]) -> ChatCompletionRequest:
    """The chat request another API's body was turned into; what it cannot be is a 400."""
    try:
        return ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors()) from None


@dataclass
class ChatRun:
    """A conversation submitted (chat, Responses and Messages alike): its engine requests and
    how their output is read."""

    group: RequestGroup
    prompt: list[int]
    tools: ToolPlan
    prompt_tail: str
    output: OutputFormat
    thinking_asked: bool | None

    def reader(self) -> ChoiceReader:
        return self.output.reader(self.tools, self.prompt_tail, self.thinking_asked)

    def ending(self, choice: sv.Choice) -> Ending:
        """A whole single choice's ending, its output as blocks (Responses, Messages)."""
        reader, blocks = self.reader(), Blocks()
        blocks.feed(reader.read(choice.text))
        blocks.close()
        reason = reader.finish_reason(choice.finish_reason)
        tokens = len(choice.token_ids)
        return Ending(reason, choice.stop_reason, tokens, choice.num_cached_tokens, blocks.done)

    async def steps(self) -> AsyncIterator[Step | Ending]:
        """A single choice's output as block steps as it streams, then its ``Ending``."""
        reader, blocks, tokens = self.reader(), Blocks(), 0
        async for _, delta in self.group:
            tokens += len(delta.token_ids)
            events = reader.feed(delta.text)
            if delta.finish_reason is None:
                for step in blocks.feed(events):
                    yield step
                continue
            for step in blocks.feed(events + reader.finish()) + blocks.close():
                yield step
            reason = reader.finish_reason(delta.finish_reason)
            yield Ending(reason, delta.stop_reason, tokens, delta.num_cached_tokens, blocks.done)


@dataclass(frozen=True)
class Ending:
    """How a streamed single choice ended: its finish reason (``tool_calls`` for complete
    calls), stop reason (the stop string or token), tokens, and all its blocks."""

    finish_reason: str | None
    stop_reason: str | int | None
    output_tokens: int
    cached_tokens: int
    blocks: list[Block]


async def start(state: sv.ServerState, request: Request, body: ChatCompletionRequest) -> ChatRun:
    """Check, render and submit a conversation; every refusal is an APIError."""
    sv.check_model(state, body.model)
    sv.check_n(state, body.n)
    tools = body.tool_plan
    spec = await constraint(state, body, tools)
    prompt, tail, prompt_images = await rendered(state, body)
    params = sv.sampling_params(state, body, body.token_limit, len(prompt), body.num_logprobs, spec)
    params.kept_special_token_ids = state.output.kept_tokens(tools, body.thinking_asked)
    traffic = sv.traffic_class(state, request)
    group = await sv.submit(state, request, [prompt], [params], body.n, traffic, prompt_images)
    return ChatRun(group, prompt, tools, tail, state.output, body.thinking_asked)


async def rendered(
    state: sv.ServerState, body: ChatCompletionRequest
) -> tuple[list[int], str, PromptImages | None]:
    """The conversation's prompt as the model reads it (its images' tokens in place), the
    text of its last tokens, and the images."""
    urls = [url for m in body.messages for url in m.image_urls()]
    images = await check_images(state, urls)
    prompt, tail = await asyncio.to_thread(_render, state.tokenizer, body, body.tool_plan)
    if not images:
        return prompt, tail, None
    prompt, prompt_images = with_images(state, prompt, images)
    return prompt, tail, prompt_images


TEMPLATE_ERRORS = (TemplateError, TypeError, ValueError, KeyError, AttributeError)
"""What a chat template raises for a conversation or variables it cannot render."""


def _render(tokenizer: Any, body: ChatCompletionRequest, tools: ToolPlan) -> tuple[list[int], str]:
    """The prompt and its tail; 400 when the template cannot render the request (its own
    raise_exception, or a chat_template_kwargs value it cannot use)."""
    kwargs = body.chat_template_kwargs
    try:
        prompt = render_chat(tokenizer, body.messages, tools.template_tools(), kwargs)
    except TEMPLATE_ERRORS as exc:
        message = f"the chat template cannot render this request: {exc}"[:MAX_LOGGED_CHARS]
        raise APIError(400, message, param="messages", code="invalid_value") from None
    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:], skip_special_tokens=False)
    return prompt, str(tail)


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    state = sv.get_state(request)
    run = await start(state, request, body)
    response_id = f"chatcmpl-{uuid.uuid4().hex}"
    if body.stream:
        return sv.GroupStream(run.group, _stream(state, body, run, response_id))
    choices = await sv.collect(request, run.group, body.n)
    return JSONResponse(
        {
            "id": response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": state.model_name,
            "choices": [_choice(state, body, run, i, c) for i, c in enumerate(choices)],
            "usage": sv.usage([run.prompt], choices),
        }
    )


def _choice(
    state: sv.ServerState, body: ChatCompletionRequest, run: ChatRun, index: int, c: sv.Choice
) -> dict[str, Any]:
    reader = run.reader()
    reasoning, content, calls = reader.whole(c.text)
    reply: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning is not None:
        reply["reasoning_content"] = reasoning or None
    if calls:
        reply["tool_calls"] = calls
    return {
        "index": index,
        "message": reply,
        "logprobs": _logprobs(state, c.logprobs, body) if body.logprobs else None,
        "finish_reason": reader.finish_reason(c.finish_reason),
    }


def _delta(event: OutputEvent) -> dict[str, Any]:
    if isinstance(event, Reasoning):
        return {"reasoning_content": event.text}
    return {"content": event} if isinstance(event, str) else stream_delta(event)


async def _stream(
    state: sv.ServerState, body: ChatCompletionRequest, run: ChatRun, response_id: str
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
    readers = [run.reader() for _ in range(body.n)]
    try:
        for i in range(body.n):
            yield chunk(i, {"role": "assistant", "content": None if run.tools.forced else ""})
        async for index, delta in run.group:
            completion_tokens += len(delta.token_ids)
            reader = readers[index]
            events = reader.feed(delta.text)
            if delta.finish_reason is not None:
                events += reader.finish()
            extra: dict[str, Any] = {}
            if body.logprobs and delta.logprobs:
                extra["logprobs"] = _logprobs(state, delta.logprobs, body)
            deltas = [_delta(e) for e in events] or ([{"content": ""}] if extra else [])
            for k, item in enumerate(deltas):
                yield chunk(index, item, **(extra if k == 0 else {}))
            if delta.finish_reason is not None:
                yield chunk(index, {}, finish_reason=reader.finish_reason(delta.finish_reason))
        if body.include_usage:
            counts = sv.usage_counts(len(run.prompt), completion_tokens)
            yield sv.usage_chunk(
                response_id, "chat.completion.chunk", created, state.model_name, counts
            )
    finally:
        run.group.close()


def _logprobs(
    state: sv.ServerState, positions: list[list[TokenLogprob]], body: ChatCompletionRequest
) -> dict[str, Any]:
    def entry(e: TokenLogprob) -> dict[str, Any]:
        text = sv.token_text(state, e)
        return {"token": text, "logprob": sv.json_logprob(e), "bytes": list(text.encode())}

    content = []
    for position in positions:
        item = entry(position[0])
        item["top_logprobs"] = [entry(e) for e in sv.top_entries(position, body.top_logprobs or 0)]
        content.append(item)
    return {"content": content}
