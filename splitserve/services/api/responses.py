"""POST /v1/responses (OpenAI Responses, stateless): the body becomes a chat conversation
(responses_protocol.py) that runs as a chat completion does (chat.start); the output's blocks
become output items (messages, function calls, reasoning), streamed as Responses events."""

from __future__ import annotations

import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from splitserve.services.api import serving as sv
from splitserve.services.api.auth import check_api_key
from splitserve.services.api.chat import ChatRun, Ending, conversation, start
from splitserve.services.api.errors import APIError
from splitserve.services.api.json_body import CheckedRoute
from splitserve.services.api.output import Block, Step
from splitserve.services.api.responses_protocol import ResponsesRequest

router = APIRouter(dependencies=[Depends(check_api_key)], route_class=CheckedRoute)
ITEM_PREFIX = {"text": "msg", "reasoning": "rs", "call": "fc"}


def _error_event(error: APIError) -> str:
    data = {"type": "error", "code": error.code, "message": error.message, "param": error.param}
    return f"event: error\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


RESPONSES_STREAM = sv.StreamStyle(_error_event, "")


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Any:
    state = sv.get_state(request)
    run = await start(state, request, conversation(body.chat_body()))
    answer = _Answer(state, body, f"resp_{uuid.uuid4().hex}", int(time.time()), run)
    if body.stream:
        return sv.GroupStream(run.group, answer.stream(), RESPONSES_STREAM)
    [choice] = await sv.collect(request, run.group, 1)
    return JSONResponse(answer.response(run.ending(choice)))


@dataclass
class _Answer:
    """One response: its object, its items, its events."""

    state: sv.ServerState
    body: ResponsesRequest
    id: str
    created: int
    run: ChatRun
    sequence: Iterator[int] = field(default_factory=itertools.count)

    def response(self, ending: Ending | None) -> dict[str, Any]:
        """The response object: in progress (no ending yet), completed or incomplete."""
        body = self.body
        status = "in_progress"
        if ending is not None:
            status = "incomplete" if ending.finish_reason == "length" else "completed"
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.state.model_name,
            "output": [self.item(b, "completed") for b in ending.blocks] if ending else [],
            "usage": self._usage(ending) if ending else None,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "error": None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "parallel_tool_calls": True,
            "previous_response_id": None,
            "store": False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "tool_choice": _dumped(body.tool_choice) or "auto",
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "text": {"format": body.text.format.model_dump(by_alias=True, exclude_none=True)}
            if body.text is not None and body.text.format is not None
            else {"format": {"type": "text"}},
            "truncation": "disabled",
            "metadata": (body.model_extra or {}).get("metadata") or {},
            "user": body.user,
        }

    def _usage(self, ending: Ending) -> dict[str, Any]:
        prompt = len(self.run.prompt)
        return {
            "input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": ending.cached_tokens},
            "output_tokens": ending.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + ending.output_tokens,
        }

    def item_id(self, block: Block) -> str:
        return f"{ITEM_PREFIX[block.kind]}_{self.id[5:]}_{block.index}"

    def item(self, block: Block, status: str) -> dict[str, Any]:
        """The block's output item; in progress: without its text yet."""
        text = block.text if status == "completed" else ""
        item: dict[str, Any] = {"id": self.item_id(block), "status": status}
        if block.kind == "call":
            kind = {"type": "function_call", "call_id": block.call_id, "name": block.name}
            return {**item, **kind, "arguments": text}
        parts = [_part(block, text)] if status == "completed" else []
        if block.kind == "reasoning":
            return {**item, "type": "reasoning", "summary": [], "content": parts}
        return {**item, "type": "message", "role": "assistant", "content": parts}

    def event(self, kind: str, **data: Any) -> str:
        data = {"type": kind, "sequence_number": next(self.sequence), **data}
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"

    async def stream(self) -> AsyncIterator[str]:
        try:
            yield self.event("response.created", response=self.response(None))
            yield self.event("response.in_progress", response=self.response(None))
            async for step in self.run.steps():
                if isinstance(step, Ending):
                    done = self.response(step)
                    yield self.event(f"response.{done['status']}", response=done)
                else:
                    for kind, data in self._step_events(step):
                        yield self.event(kind, **data)
        finally:
            self.run.group.close()

    def _step_events(self, step: Step) -> list[tuple[str, dict[str, Any]]]:
        what, block, delta = step
        where = {"item_id": self.item_id(block), "output_index": block.index}
        text_where = {**where, "content_index": 0}
        if what == "start":
            events = [
                (
                    "response.output_item.added",
                    {"output_index": block.index, "item": self.item(block, "in_progress")},
                )
            ]
            if block.kind != "call":
                events.append(
                    ("response.content_part.added", {**text_where, "part": _part(block, "")})
                )
            return events
        if what == "delta":
            if block.kind == "call":
                return [("response.function_call_arguments.delta", {**where, "delta": delta})]
            if block.kind == "reasoning":
                return [("response.reasoning_text.delta", {**text_where, "delta": delta})]
            return [("response.output_text.delta", {**text_where, "delta": delta, "logprobs": []})]
        done = (
            "response.output_item.done",
            {"output_index": block.index, "item": self.item(block, "completed")},
        )
        if block.kind == "call":
            arguments = {**where, "name": block.name, "arguments": block.text}
            return [("response.function_call_arguments.done", arguments), done]
        if block.kind == "reasoning":
            text_done = ("response.reasoning_text.done", {**text_where, "text": block.text})
        else:
            text_done = (
                "response.output_text.done",
                {**text_where, "text": block.text, "logprobs": []},
            )
        part_done = ("response.content_part.done", {**text_where, "part": _part(block, block.text)})
        return [text_done, part_done, done]


def _part(block: Block, text: str) -> dict[str, Any]:
    if block.kind == "reasoning":
        return {"type": "reasoning_text", "text": text}
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _dumped(value: Any) -> Any:
    return value.model_dump() if hasattr(value, "model_dump") else value
