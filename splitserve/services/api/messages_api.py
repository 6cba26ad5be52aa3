"""POST /v1/messages (Anthropic Messages): the body becomes a chat conversation
(messages_protocol.py) that runs as a chat completion does (chat.start); the output's blocks
become content blocks (text, thinking, tool_use), streamed as Anthropic's events. Errors on
this path have Anthropic's shape (errors.py)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from splitserve.services.api import serving as sv
from splitserve.services.api.auth import check_api_key
from splitserve.services.api.chat import ChatRun, Ending, conversation, rendered, start
from splitserve.services.api.errors import APIError, anthropic_body
from splitserve.services.api.json_body import CheckedRoute
from splitserve.services.api.messages_protocol import MessagesRequest, TokenCountRequest
from splitserve.services.api.output import Block, Step

router = APIRouter(dependencies=[Depends(check_api_key)], route_class=CheckedRoute)


def event(kind: str, data: dict[str, Any]) -> str:
    data = {"type": kind, **data}
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


def _error_event(error: APIError) -> str:
    return event("error", anthropic_body(error))


MESSAGES_STREAM = sv.StreamStyle(_error_event, "")


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Any:
    state = sv.get_state(request)
    run = await start(state, request, conversation(body.chat_body()))
    message_id = f"msg_{uuid.uuid4().hex}"
    if body.stream:
        return sv.GroupStream(run.group, _stream(state, run, message_id), MESSAGES_STREAM)
    [choice] = await sv.collect(request, run.group, 1)
    ending = run.ending(choice)
    message = _message(state, run, message_id, ending)
    return JSONResponse(
        {**message, "content": [_content(b, b.text) for b in ending.blocks], **_stop(ending)}
    )


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: TokenCountRequest, request: Request) -> Any:
    """The prompt's tokens, as the message would count them in usage.input_tokens."""
    state = sv.get_state(request)
    chat = conversation(body.chat_body())
    sv.check_model(state, chat.model)
    prompt, _, _ = await rendered(state, chat)
    return JSONResponse({"input_tokens": len(prompt)})


def _message(
    state: sv.ServerState, run: ChatRun, message_id: str, ending: Ending | None
) -> dict[str, Any]:
    usage = {
        "input_tokens": len(run.prompt),
        "output_tokens": ending.output_tokens if ending else 0,
    }
    if ending is not None:
        usage["cache_read_input_tokens"] = ending.cached_tokens
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": state.model_name,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }


def _stop(ending: Ending) -> dict[str, Any]:
    """Anthropic's stop_reason and stop_sequence for the choice's finish."""
    reason, sequence = "end_turn", None
    if ending.finish_reason == "tool_calls":
        reason = "tool_use"
    elif ending.finish_reason == "length":
        reason = "max_tokens"
    elif isinstance(ending.stop_reason, str):
        reason, sequence = "stop_sequence", ending.stop_reason
    return {"stop_reason": reason, "stop_sequence": sequence}


def _content(block: Block, text: str) -> dict[str, Any]:
    """The block as a content block (``text``: what it holds so far). Call arguments that are
    not a JSON object (cut off by max_tokens) are text."""
    if block.kind == "reasoning":
        return {"type": "thinking", "thinking": text, "signature": ""}
    if block.kind == "call":
        try:
            arguments = json.loads(text) if text else {}
        except (ValueError, RecursionError):
            arguments = None
        if isinstance(arguments, dict):
            return {"type": "tool_use", "id": block.call_id, "name": block.name, "input": arguments}
    return {"type": "text", "text": text}


def _delta(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "thinking_delta", "thinking": text}
    if block.kind == "call":
        return {"type": "input_json_delta", "partial_json": text}
    return {"type": "text_delta", "text": text}


async def _stream(state: sv.ServerState, run: ChatRun, message_id: str) -> AsyncIterator[str]:
    try:
        yield event("message_start", {"message": _message(state, run, message_id, None)})
        async for step in run.steps():
            if isinstance(step, Ending):
                usage = {"output_tokens": step.output_tokens}
                yield event("message_delta", {"delta": _stop(step), "usage": usage})
                yield event("message_stop", {})
            else:
                yield _step_event(step)
    finally:
        run.group.close()


def _step_event(step: Step) -> str:
    what, block, text = step
    if what == "start":
        return event(
            "content_block_start", {"index": block.index, "content_block": _content(block, "")}
        )
    if what == "delta":
        return event("content_block_delta", {"index": block.index, "delta": _delta(block, text)})
    return event("content_block_stop", {"index": block.index})
