"""Request shapes of structured output and tool calling: OpenAI's `response_format`, `tools`,
`tool_choice` and `parallel_tool_calls`, and vLLM's `structured_outputs`.

Only shapes are checked here (pydantic, a 400 for a wrong one); whether the engine accepts a
schema, regex or grammar is decided by compiling it (constraints.py)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# OpenAI's rule for function and response-format names.
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the output must match."""

    model_config = ConfigDict(populate_by_name=True)

    name: str = Field(pattern=NAME_PATTERN)  # the format's name
    description: str | None = None  # what the format is for (unused)
    # The JSON schema; absent: any JSON object. (`schema` shadows a BaseModel attribute.)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # OpenAI's strict mode (the output always matches the schema)


class ResponseFormat(BaseModel):
    """OpenAI's `response_format`: free text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]  # what the output is
    json_schema: JsonSchemaFormat | None = None  # with type json_schema only

    @model_validator(mode="after")
    def _schema_with_its_type(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema must be given exactly when type is json_schema")
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint on the output."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    # A JSON schema, as an object or as JSON text. (`json` shadows a BaseModel method.)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None  # the output fully matches this regex (Rust regex syntax)
    choice: list[str] | None = Field(default=None, min_length=1)  # the output is one of these
    grammar: str | None = None  # a Lark or GBNF (llama.cpp) grammar
    json_object: bool | None = None  # true: any JSON object

    @model_validator(mode="after")
    def _exactly_one(self):
        given = [
            name
            for name in ("json_", "regex", "choice", "grammar")
            if getattr(self, name) is not None
        ]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar, json_object")
        if isinstance(self.json_, str):
            try:
                self.json_ = json.loads(self.json_)
            except ValueError as exc:
                raise ValueError(f"json is not valid JSON: {exc}") from None
            if not isinstance(self.json_, dict | bool):
                raise ValueError("json must be a JSON schema (an object)")
        return self


class FunctionDefinition(BaseModel):
    """A tool's function: its name and the JSON schema of its arguments."""

    name: str = Field(pattern=NAME_PATTERN)  # what the model calls it by
    description: str | None = None  # what it does (the template shows it to the model)
    parameters: dict[str, Any] | None = None  # JSON schema of the arguments (None: none)
    strict: bool | None = None  # arguments always match `parameters`


class ChatTool(BaseModel):
    """One entry of `tools`."""

    type: Literal["function"]  # the only kind of tool
    function: FunctionDefinition  # the function


class NamedFunction(BaseModel):
    """The function a named tool_choice forces."""

    name: str  # one of the tools' names


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]  # the only kind
    function: NamedFunction  # which function


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice
