"""Structured-output fields of a request body: OpenAI's ``response_format`` and vLLM's
``structured_outputs``, turned into the engine's StructuredOutputsParams.

Only the shape is checked here (pydantic, no xgrammar); whether a constraint can be used is
``constraints.ConstraintCheck``'s question, asked before the request reaches a worker.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.engine.sampling_params import KINDS, StructuredOutputsParams
from splitserve.services.api.errors import field_error


class JSONSchemaSpec(BaseModel):
    """OpenAI's ``json_schema`` object; ``strict`` is accepted, the output always follows
    the schema (it is enforced by the grammar, not asked for)."""

    model_config = ConfigDict(populate_by_name=True)

    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: text (no constraint), json_object, or json_schema with
    its ``json_schema`` object."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaSpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise field_error(
                "response_format",
                "response_format: json_schema is required with type json_schema, and only then",
            )
        return self


FIELDS = {"json": "json_"}


class StructuredOutputsBody(BaseModel):
    """vLLM's ``structured_outputs``: exactly one of json (a schema, or its JSON text), regex,
    choice, grammar (EBNF as xgrammar reads it), json_object."""

    model_config = ConfigDict(extra="forbid")

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None

    @model_validator(mode="after")
    def _check(self) -> StructuredOutputsBody:
        given = [
            name for name in KINDS if getattr(self, FIELDS.get(name, name)) not in (None, False)
        ]
        if len(given) != 1:
            raise field_error(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                + (f" (got {', '.join(given)})" if given else ""),
            )
        if self.choice is not None and not (self.choice and all(self.choice)):
            raise field_error(
                "structured_outputs",
                "structured_outputs.choice must be a non-empty list of non-empty strings",
            )
        return self

    def params(self) -> StructuredOutputsParams:
        """The engine's constraint; ValueError naming what is wrong (none or several given)."""
        schema = self.json_
        return StructuredOutputsParams(
            json=json.dumps(schema) if isinstance(schema, dict) else schema,
            regex=self.regex,
            choice=self.choice,
            grammar=self.grammar,
            json_object=bool(self.json_object),
        )


def requested(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputsBody | None,
) -> tuple[StructuredOutputsParams | None, str]:
    """(the constraint a body asks for or None, the field that asked for it).

    A schema travels as JSON text: its numbers then never meet msgpack's 64-bit limit, and the
    engine reads the text as it would the dict (the cache key is the same)."""
    if structured_outputs is not None:
        return structured_outputs.params(), "structured_outputs"
    if response_format is None or response_format.type == "text":
        return None, "response_format"
    if response_format.json_schema is None:
        return StructuredOutputsParams(json_object=True), "response_format"
    schema = json.dumps(response_format.json_schema.schema_)
    return StructuredOutputsParams(json=schema), "response_format"


def asks_for_constraint(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputsBody | None
) -> bool:
    return structured_outputs is not None or not (
        response_format is None or response_format.type == "text"
    )
