"""The body of POST /v1/messages (Anthropic Messages), and the chat conversation it becomes:
``system`` a system message, ``tool_use`` blocks an assistant's tool calls, ``tool_result``
blocks tool messages, ``thinking`` blocks of earlier turns dropped; ``tool_choice`` any is
required, tool a named function; ``thinking`` sets the chat template's ``enable_thinking``."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from splitserve.services.api.protocol import MAX_STOP, Count
from splitserve.services.api.responses_protocol import extensions
from splitserve.services.api.tools import FUNCTION_NAME, MAX_TOOLS


class TextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ImageSource(BaseModel):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None

    def url_of(self) -> str:
        if self.type == "url":
            return self.url or ""
        return f"data:{self.media_type or ''};base64,{self.data or ''}"


class ImageBlock(BaseModel):
    type: Literal["image"]
    source: ImageSource


class ToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1)]
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1)]
    content: str | list[TextBlock | ImageBlock] | None = None
    is_error: bool | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(b.text for b in self.content if isinstance(b, TextBlock))


class ThinkingBlock(BaseModel):
    """Reasoning of an earlier turn: not part of the next prompt."""

    type: Literal["thinking", "redacted_thinking"]


ContentBlock = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class Message(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def chat_messages(self) -> list[dict[str, Any]]:
        if isinstance(self.content, str):
            return [{"role": self.role, "content": self.content}]
        messages: list[dict[str, Any]] = [
            {"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()}
            for b in self.content
            if isinstance(b, ToolResultBlock)
        ]
        parts = [_part(b) for b in self.content if isinstance(b, TextBlock | ImageBlock)]
        calls = [_call(b) for b in self.content if isinstance(b, ToolUseBlock)]
        if calls:
            messages.append({"role": "assistant", "content": parts or None, "tool_calls": calls})
        elif parts:
            messages.append({"role": self.role, "content": parts})
        return messages


def _part(block: TextBlock | ImageBlock) -> dict[str, Any]:
    if isinstance(block, TextBlock):
        return {"type": "text", "text": block.text}
    return {"type": "image_url", "image_url": {"url": block.source.url_of()}}


def _call(block: ToolUseBlock) -> dict[str, Any]:
    arguments = json.dumps(block.input, ensure_ascii=False)
    return {
        "id": block.id,
        "type": "function",
        "function": {"name": block.name, "arguments": arguments},
    }


class Tool(BaseModel):
    type: Literal["custom"] | None = None
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(BaseModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(BaseModel):
    type: Literal["enabled", "disabled"]
    budget_tokens: Annotated[int, Field(ge=0)] | None = None


class MessagesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Count
    messages: Annotated[list[Message], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    stop_sequences: Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    top_k: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    stream: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None

    @field_validator("tool_choice")
    @classmethod
    def _named(cls, choice: ToolChoice | None) -> ToolChoice | None:
        if choice is not None and (choice.type == "tool") != (choice.name is not None):
            raise ValueError("name is given with type tool, and only then")
        return choice

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request that this one is (validated by the caller)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_tokens": self.max_tokens,
            "stop": self.stop_sequences,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k or 0,
            "stream": self.stream,
            **extensions(self.model_extra),
        }
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        "name": t.name,
                        "description": t.description,
                        "parameters": t.input_schema,
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if choice is not None:
            named = {"type": "function", "function": {"name": choice.name}}
            modes = {"auto": "auto", "any": "required", "none": "none"}
            body["tool_choice"] = named if choice.type == "tool" else modes[choice.type]
        if self.thinking is not None:
            body["chat_template_kwargs"] = {"enable_thinking": self.thinking.type == "enabled"}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        system = self.system
        if isinstance(system, list):
            system = "\n".join(block.text for block in system)
        messages = [{"role": "system", "content": system}] if system else []
        for message in self.messages:
            messages += message.chat_messages()
        return messages


class TokenCountRequest(MessagesRequest):
    """/v1/messages/count_tokens: a message body without max_tokens."""

    max_tokens: Count = 1
