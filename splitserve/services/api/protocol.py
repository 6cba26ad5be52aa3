"""Request bodies of the OpenAI endpoints (pydantic); value ranges are checked here.

Every number is bounded to what the engine and the msgpack codec carry: integers fit in 64
bits (seeds) or 31 (counts), floats are finite and within their documented ranges. Fields
that splitserve does not implement but that change what a client gets (logit_bias, tools on
completions, ...) are refused with an error that names them rather than ignored; other
unknown fields are ignored, as OpenAI-compatible servers usually do. The structured-output
fields are in structured.py, the tool fields in tools.py.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.services.api.errors import field_error
from splitserve.services.api.structured import (
    ResponseFormat,
    StructuredOutputsBody,
    asks_for_constraint,
    requested,
)
from splitserve.services.api.tools import ToolChoice, ToolPlan, Tools, plan

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
"""Fields refused unless absent or set to the value that asks for nothing (name -> those; of
that value's type: ``true`` does not pass for 1)."""
CHAT_UNSUPPORTED = {**UNSUPPORTED, "parallel_tool_calls": (None, True)}
COMPLETION_UNSUPPORTED = {**UNSUPPORTED, "tools": (None, []), "tool_choice": (None, "none")}

MAX_COUNT = 2**31 - 1
"""Bound of token counts (max_tokens, min_tokens, top_k): past any context, within int32."""
MAX_STOP = 16
MAX_STOP_CHARS = 1024

TEMPLATE_OWN_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
"""apply_chat_template's own arguments: chat_template_kwargs may not set them."""

Count = Annotated[int, Field(gt=0, le=MAX_COUNT)]
TokenId = Annotated[int, Field(ge=0, le=MAX_COUNT, strict=True)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""A signed 64-bit seed; choice i samples with seed + i, which stays within the 64 bits that
torch's generator and msgpack take while i < 2**63."""


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageURL(BaseModel):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImageURLPart(BaseModel):
    """An image, as a data: URL (PNG, JPEG, WebP) or an http(s) URL of an allowed host."""

    type: Literal["image_url"]
    image_url: ImageURL


ContentPart = Annotated[TextPart | ImageURLPart, Field(discriminator="type")]


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    """A call an assistant message made (sent back in the conversation)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall

    def template_call(self) -> dict[str, Any]:
        """As chat templates read it: the arguments as an object when they parse as one."""
        try:
            arguments: Any = json.loads(self.function.arguments)
        except (json.JSONDecodeError, RecursionError):
            arguments = self.function.arguments
        if not isinstance(arguments, dict):
            arguments = self.function.arguments
        function = {"name": self.function.name, "arguments": arguments}
        return {"id": self.id, "type": "function", "function": function}


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_roles(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages have tool_calls")
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (null only for assistant tool_calls)")
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a tool message needs the tool_call_id it answers")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it."""
        message: dict[str, Any] = {"role": self.role, "content": self.template_content()}
        if self.tool_calls:
            message["tool_calls"] = [call.template_call() for call in self.tool_calls]
        if self.role == "tool":
            message["tool_call_id"] = self.tool_call_id
        return message

    def image_urls(self) -> list[str]:
        if self.content is None or isinstance(self.content, str):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageURLPart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """What the chat template gets: the text, or the parts when there are images (each
        image a {"type": "image"} part that the template renders as the image token)."""
        if not self.image_urls():
            return self.text()
        return [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in self.content or []
            if not isinstance(p, str)
        ]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and completions share."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    refused: ClassVar[dict[str, tuple[Any, ...]]] = UNSUPPORTED

    model: str
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP)] | None = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Extensions that vLLM users know (not in OpenAI's API).
    top_k: Annotated[int, Field(ge=-1, le=MAX_COUNT)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0)] = 1.0
    min_tokens: Annotated[int, Field(ge=0, le=MAX_COUNT)] = 0
    ignore_eos: bool = False
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsBody | None = None

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, stop: str | list[str] | None) -> str | list[str] | None:
        stops = [stop] if isinstance(stop, str) else stop or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop sequences")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop sequence has at most {MAX_STOP_CHARS} characters")
        return stop

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> SamplingFields:
        extra = self.model_extra or {}
        for name, allowed in self.refused.items():
            if name in extra and not _asks_nothing(extra[name], allowed):
                raise field_error(
                    name, f"{name} is not supported by this server", "unsupported_parameter"
                )
        best_of = extra.get("best_of")
        if best_of is not None and (type(best_of) is not int or best_of != self.n):
            raise field_error(
                "best_of",
                f"best_of must be absent or equal n ({self.n}): choosing the best of more "
                "samples than are returned is not supported by this server",
                "unsupported_parameter",
            )
        if self.structured_outputs is not None and asks_for_constraint(self.response_format, None):
            raise field_error(
                "structured_outputs", "give response_format or structured_outputs, not both"
            )
        return self

    def constraint(self) -> tuple[StructuredOutputsParams | None, str]:
        """The structured output the body asks for, and the field that asks."""
        return requested(self.response_format, self.structured_outputs)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


def _asks_nothing(value: Any, allowed: tuple[Any, ...]) -> bool:
    return any(value == a and type(value) is type(a) for a in allowed)


class ChatCompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = CHAT_UNSUPPORTED

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    """Variables for the chat template (vLLM's field), e.g. ``{"enable_thinking": false}``."""

    @field_validator("chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
        for key in kwargs or {}:
            if key in TEMPLATE_OWN_ARGUMENTS or not key.isidentifier():
                raise ValueError(f"{key!r} is not a chat template variable that can be set")
        return kwargs

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @model_validator(mode="after")
    def _check_tool_choice(self) -> ChatCompletionRequest:
        choice = self.tool_choice
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise field_error("tools", "tools: two tools have the same function name")
        if choice is None or choice in ("none", "auto"):
            return self
        if not self.tools:
            raise field_error("tool_choice", "tool_choice required or a function needs tools")
        if not isinstance(choice, str) and choice.function.name not in names:
            raise field_error(
                "tool_choice",
                f"tool_choice: no tool is the function {choice.function.name!r}",
            )
        if asks_for_constraint(self.response_format, self.structured_outputs):
            raise field_error(
                "tool_choice",
                "tool_choice required or a function cannot be combined with response_format "
                "or structured_outputs",
            )
        return self

    @property
    def tool_plan(self) -> ToolPlan:
        return plan(self.tools, self.tool_choice)

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def thinking_asked(self) -> bool | None:
        """The request's thinking switch: chat_template_kwargs' enable_thinking, if a bool."""
        asked = (self.chat_template_kwargs or {}).get("enable_thinking")
        return asked if isinstance(asked, bool) else None

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    refused: ClassVar[dict[str, tuple[Any, ...]]] = COMPLETION_UNSUPPORTED

    prompt: Prompt
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, prompt: Any) -> Any:
        if prompt in ("", []) or (isinstance(prompt, list) and any(p in ("", []) for p in prompt)):
            raise ValueError("must not be empty")
        return prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def num_prompts(self) -> int:
        """Prompts in the body: one for a string or a list of token ids, else the list's."""
        if isinstance(self.prompt, str) or all(isinstance(p, int) for p in self.prompt):
            return 1
        return len(self.prompt)

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs
