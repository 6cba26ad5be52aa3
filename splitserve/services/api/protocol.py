"""Request bodies of the OpenAI endpoints (pydantic); value ranges are checked here.

Every number is bounded to what the engine and the msgpack codec carry: integers fit in 64
bits (seeds) or 31 (counts), floats are finite and within their documented ranges. Fields
that splitserve does not implement but that change what a client gets (tools,
response_format other than text, logit_bias, ...) are refused with an error that names them
rather than ignored; other unknown fields are ignored, as OpenAI-compatible servers usually do.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "response_format": (None, {"type": "text"}),
    "best_of": (None, 1),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "guided_json": (None,),
    "guided_regex": (None,),
    "guided_choice": (None,),
    "guided_grammar": (None,),
}
"""Fields refused unless absent or set to the value that asks for nothing (name -> those)."""

MAX_COUNT = 2**31 - 1
"""Bound of token counts (max_tokens, min_tokens, top_k): past any context, within int32."""
MAX_STOP = 16
MAX_STOP_CHARS = 1024

Count = Annotated[int, Field(gt=0, le=MAX_COUNT)]
Seed = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
"""A signed 64-bit seed; choice i samples with seed + i, which stays within the 64 bits that
torch's generator and msgpack take while i < 2**63."""


def field_error(param: str, message: str, code: str = "invalid_value") -> PydanticCustomError:
    """A validation error of a model validator that names its field (errors.py reads
    ``param`` and ``code`` back: a model-level error has no location of its own)."""
    return PydanticCustomError(code, message, {"param": param})


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


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant"]
    content: str | list[ContentPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content if isinstance(part, TextPart))

    def image_urls(self) -> list[str]:
        if isinstance(self.content, str):
            return []
        return [p.image_url.url for p in self.content if isinstance(p, ImageURLPart)]

    def template_content(self) -> str | list[dict[str, str]]:
        """What the chat template gets: the text, or the parts when there are images (each
        image a {"type": "image"} part that the template renders as the image token)."""
        if not self.image_urls():
            return self.text()
        return [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in self.content
            if not isinstance(p, str)
        ]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """What chat and completions share."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    max_tokens: Count | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_COUNT)] = 1
    stop: str | list[str] | None = None
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
        for name, allowed in UNSUPPORTED.items():
            if name in extra and extra[name] not in allowed:
                raise field_error(
                    name, f"{name} is not supported by this server", "unsupported_parameter"
                )
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "top_logprobs requires logprobs to be true")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
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
