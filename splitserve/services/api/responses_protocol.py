"""The body of POST /v1/responses (OpenAI Responses), and the chat conversation it becomes.

Stateless: every turn comes in ``input`` (text, or items: messages, function calls and their
outputs; reasoning items sent back are dropped from the prompt). ``previous_response_id``,
``conversation`` and ``background`` need stored responses, which this server does not keep:
they are refused with a 400 that says so. ``text.format`` is response_format, ``tools`` are
function tools (other tool types are refused)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, model_validator

from splitserve.services.api.errors import field_error
from splitserve.services.api.protocol import Count
from splitserve.services.api.tools import FUNCTION_NAME, MAX_TOOLS

EXTENSIONS = (
    "structured_outputs",
    "seed",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "stop_token_ids",
)
"""Chat fields the other APIs' bodies may carry too (vLLM's extensions), passed on as given."""

STATEFUL = {
    "previous_response_id": "previous_response_id: this server does not store responses; "
    "send the whole conversation in input (store: false)",
    "conversation": "conversation: this server does not store conversations; send the whole "
    "conversation in input",
}


class TextContent(BaseModel):
    type: Literal["input_text", "output_text", "text", "reasoning_text"]
    text: str


class ImageContent(BaseModel):
    type: Literal["input_image"]
    image_url: str
    detail: Literal["auto", "low", "high"] | None = None


Content = Annotated[TextContent | ImageContent, Field(discriminator="type")]


class MessageItem(BaseModel):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Content]

    def chat_message(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        parts = [
            {"type": "text", "text": p.text}
            if isinstance(p, TextContent)
            else {"type": "image_url", "image_url": {"url": p.image_url}}
            for p in self.content
        ]
        return {"role": role, "content": parts}


class FunctionCallItem(BaseModel):
    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1)]
    name: str
    arguments: str


class FunctionCallOutputItem(BaseModel):
    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1)]
    output: str | list[TextContent]

    def text(self) -> str:
        if isinstance(self.output, str):
            return self.output
        return "".join(part.text for part in self.output)


class ReasoningItem(BaseModel):
    """A reasoning item of an earlier answer: not part of the next prompt."""

    type: Literal["reasoning"]


def extensions(extra: dict[str, Any] | None) -> dict[str, Any]:
    """The EXTENSIONS among a body's extra fields."""
    return {name: value for name, value in (extra or {}).items() if name in EXTENSIONS}


def _item_type(value: Any) -> str:
    if isinstance(value, dict):
        return str(value.get("type", "message"))
    return str(getattr(value, "type", "message"))


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(BaseModel):
    type: Literal["function"]
    name: str


class TextFormat(BaseModel):
    """``text.format``: text, json_object, or json_schema with its name and schema."""

    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    def response_format(self) -> dict[str, Any]:
        if self.type != "json_schema":
            return {"type": self.type}
        spec = {"name": self.name, "schema": self.schema_, "description": self.description}
        return {"type": "json_schema", "json_schema": spec}

    @model_validator(mode="after")
    def _check(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise field_error("text.format", "text.format: json_schema needs name and schema")
        return self


class ReasoningConfig(BaseModel):
    """``reasoning``: given, the model thinks (the template's ``enable_thinking``) unless its
    effort is none; the effort's other levels and summaries are not told apart."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    input: str | Annotated[list[Item], Field(min_length=1)]
    instructions: str | None = None
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunction | None = None
    text: TextConfig | None = None
    max_output_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    stream: bool = False
    store: bool | None = None
    background: bool | None = None
    parallel_tool_calls: bool | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_stateful(self) -> ResponsesRequest:
        extra = self.model_extra or {}
        for name, message in STATEFUL.items():
            if extra.get(name) is not None:
                raise field_error(name, message, "unsupported_parameter")
        if self.background:
            raise field_error(
                "background",
                "background: responses run in the foreground here",
                "unsupported_parameter",
            )
        return self

    def chat_body(self) -> dict[str, Any]:
        """The chat completion request that this one is (validated by the caller)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": self._messages(),
            "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "stream": self.stream,
            "user": self.user,
            "chat_template_kwargs": self._template_kwargs(),
            **extensions(self.model_extra),
        }
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                for t in self.tools
            ]
        if isinstance(self.tool_choice, NamedFunction):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.response_format()
        return body

    def _template_kwargs(self) -> dict[str, Any] | None:
        kwargs = self.chat_template_kwargs
        if self.reasoning is None:
            return kwargs
        return {"enable_thinking": self.reasoning.effort != "none", **(kwargs or {})}

    def _messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*messages, {"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, MessageItem):
                messages.append(item.chat_message())
            elif isinstance(item, FunctionCallItem):
                call = {
                    "id": item.call_id,
                    "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments},
                }
                last = messages[-1] if messages else None
                if last is None or last["role"] != "assistant":
                    last = {"role": "assistant", "content": None}
                    messages.append(last)
                last.setdefault("tool_calls", []).append(call)
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(
                    {"role": "tool", "tool_call_id": item.call_id, "content": item.text()}
                )
        return messages
