"""Structured-output parameters through real processes and the official openai client: valid
constraints and tools are accepted (generation is not constrained yet, so only the status is
checked), refused ones are 400s the client raises as BadRequestError with the parameter, and
the server keeps serving."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.helpers import assert_no_blocks_in_use

MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0}},
    "required": ["name", "age"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_valid_constraints_and_tools_are_accepted(server):
    client = server.client()
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    r = client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, max_tokens=4, response_format=fmt
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.completions.create(
        model=server.model_name,
        prompt="Digits:",
        max_tokens=4,
        extra_body={"structured_outputs": {"regex": "[0-9]{3}"}},
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    r = client.chat.completions.create(
        model=server.model_name,
        messages=MESSAGES,
        max_tokens=4,
        tools=[TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        parallel_tool_calls=False,
    )
    assert r.choices[0].finish_reason in ("stop", "length")
    assert_no_blocks_in_use(server)


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"extra_body": {"structured_outputs": {"regex": "(["}}}, "structured_outputs.regex"),
        (
            {"extra_body": {"structured_outputs": {"grammar": "start: undefined_rule"}}},
            "structured_outputs.grammar",
        ),
        (
            {"extra_body": {"structured_outputs": {"regex": "a" * 70_000}}},
            "structured_outputs.regex",
        ),
        (
            {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "other"}}},
            "tool_choice",
        ),
    ],
)
def test_refused_constraints_are_bad_requests(server, kwargs, param):
    client = server.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=server.model_name, messages=MESSAGES, max_tokens=4, **kwargs
        )
    assert exc.value.status_code == 400 and exc.value.param == param
    r = client.chat.completions.create(model=server.model_name, messages=MESSAGES, max_tokens=2)
    assert r.choices[0].message.content is not None
