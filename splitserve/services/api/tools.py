"""A chat request's ``tools`` and ``tool_choice``: their shape, and what each choice makes of
the request (``ToolPlan``): the tools the chat template sees, the constraint that holds
``required`` and a named function to the tools' schemas, and how the output is read back
(tool_calls.py).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from splitserve.engine.sampling_params import StructuredOutputsParams
from splitserve.services.api.errors import APIError
from splitserve.services.api.marked_calls import MarkedParser
from splitserve.services.api.tool_calls import ListParser, NamedParser, OutputParser
from splitserve.services.api.tool_formats import HermesParser

MAX_TOOLS = 128
FUNCTION_NAME = r"^[a-zA-Z0-9_-]{1,64}$"


class FunctionDefinition(BaseModel):
    name: Annotated[str, Field(pattern=FUNCTION_NAME)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, parameters: dict[str, Any] | None) -> dict[str, Any] | None:
        if parameters is not None and parameters.get("type", "object") != "object":
            raise ValueError('must be a JSON schema of "type": "object"')
        return parameters

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema of the arguments: parameters, an object (no parameters: ``{}`` only)."""
        return {"type": "object", **(self.parameters or {"properties": {}})}


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
Tools = Annotated[list[ToolDefinition], Field(max_length=MAX_TOOLS)]


@dataclass(frozen=True)
class ToolPlan:
    """What tools and tool_choice make of a request. mode: none, auto, required or named."""

    mode: str
    tools: tuple[ToolDefinition, ...] = ()
    name: str | None = None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools as the chat template gets them (OpenAI's form, which HF templates read)."""
        return [t.model_dump(exclude_none=True) for t in self.tools] or None

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar of required / named; 400 if the tools cannot be combined into one."""
        if self.mode == "named":
            tool = next(t for t in self.tools if t.function.name == self.name)
            return StructuredOutputsParams(json=json.dumps(tool.function.arguments_schema))
        if self.mode == "required":
            return StructuredOutputsParams(json=json.dumps(calls_schema(self.tools)))
        return None

    def parser(self, auto: type[MarkedParser] = HermesParser) -> OutputParser:
        """The output's parser; ``auto``: the format of the model's calls (tool_formats.py)."""
        if self.mode == "named":
            assert self.name is not None
            return NamedParser(self.name)
        if self.mode == "required":
            return ListParser()
        if self.mode == "auto":
            return auto(frozenset(t.function.name for t in self.tools))
        return OutputParser()

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "named")


def plan(tools: list[ToolDefinition] | None, choice: ToolChoice | None) -> ToolPlan:
    """OpenAI's defaults: auto with tools, none without. Checked already (protocol.py): a
    named function is among the tools, required and named have tools."""
    if isinstance(choice, NamedToolChoice):
        return ToolPlan("named", tuple(tools or ()), choice.function.name)
    mode = choice or ("auto" if tools else "none")
    return ToolPlan(mode if tools else "none", tuple(tools or ()))


def calls_schema(tools: tuple[ToolDefinition, ...]) -> dict[str, Any]:
    """tool_choice required: a non-empty list of calls, each ``{"name", "arguments"}`` of one of
    the tools. Each tool's ``$defs`` / ``definitions`` move to the root, where its local
    ``$ref``s find them; a tool with other references, or two that define one name
    differently, are a 400."""
    definitions: dict[str, dict[str, Any]] = {}
    calls = []
    for index, tool in enumerate(tools):
        schema = dict(tool.function.arguments_schema)
        param = f"tools.{index}.function.parameters"
        for ref in _refs(schema):
            if not ref.startswith(("#/$defs/", "#/definitions/")):
                raise APIError(
                    400,
                    f"{param}: tool_choice required cannot combine a schema with the $ref "
                    f"{ref!r} (only #/$defs/... and #/definitions/...)",
                    param=param,
                    code="invalid_value",
                )
        for key in ("$defs", "definitions"):
            for name, definition in (schema.pop(key, None) or {}).items():
                if definitions.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise APIError(
                        400,
                        f"{param}: {key}/{name} is defined differently by another tool",
                        param=param,
                        code="invalid_value",
                    )
        calls.append(
            {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "enum": [tool.function.name]},
                    "arguments": schema,
                },
                "required": ["name", "arguments"],
            }
        )
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **definitions}


def _refs(node: Any) -> Iterator[str]:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str):
            yield ref
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                yield from _refs(value)
    elif isinstance(node, list):
        for item in node:
            yield from _refs(item)
