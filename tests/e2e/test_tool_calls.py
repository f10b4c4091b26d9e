"""Tool calling through real processes (controller + CPU executor, the default model) and the
official openai client: named and required calls, single and parallel, come back as
tool_calls whose arguments validate against the tools' schemas; streamed and whole responses
assemble to the same calls; the client's parse() helpers read a pydantic tool; "auto" is
well formed whatever the model does."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.e2e.helpers import assert_no_blocks_in_use

MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
CLOCK = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 32}},
    "required": ["timezone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Forecast", "parameters": WEATHER},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time", "parameters": CLOCK},
    },
]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
# Enough for two bounded calls; greedy, so streamed and whole outputs are the same tokens.
MAX_TOKENS = 160
GREEDY = {"temperature": 0, "max_tokens": MAX_TOKENS}


def _check_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    """The message's calls as (name, arguments), each validated against its tool's schema."""
    assert message.tool_calls, message
    out = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        args = json.loads(call.function.arguments)
        jsonschema.validate(args, SCHEMAS[call.function.name])
        out.append((call.function.name, args))
    return out


def _create(server, **kwargs):
    client = server.client()
    return client.chat.completions.create(
        model=server.model_name, messages=MESSAGES, **{**GREEDY, **kwargs}
    )


def _stream(server, **kwargs) -> tuple[str, list[tuple[str, dict]], str]:
    """(content, calls, finish reason) assembled from a streamed response."""
    stream = _create(server, stream=True, **kwargs)
    content, calls, finish = "", {}, None
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": None, "arguments": ""})
                if tc.function.name:
                    assert call["name"] is None and tc.id.startswith("call_")
                    call["name"] = tc.function.name
                call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    parsed = [(c["name"], json.loads(c["arguments"])) for _, c in sorted(calls.items())]
    return content, parsed, finish


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "tool_choice,parallel,names",
    [
        (NAMED, None, {"get_weather"}),
        (NAMED, False, {"get_weather"}),
        ("required", None, {"get_weather", "get_time"}),
        ("required", False, {"get_weather", "get_time"}),
    ],
    ids=["named", "named-single", "required", "required-single"],
)
def test_forced_calls_whole_and_streamed(server, tool_choice, parallel, names):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = _create(server, tools=TOOLS, tool_choice=tool_choice, **extra)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    calls = _check_calls(choice.message, names)
    if parallel is False:
        assert len(calls) == 1
    content, streamed, finish = _stream(server, tools=TOOLS, tool_choice=tool_choice, **extra)
    assert (content, streamed, finish) == ("", calls, "tool_calls")
    assert_no_blocks_in_use(server)


def test_several_choices_each_call(server):
    # One call each: sampled parallel calls may go on until max_tokens.
    r = _create(
        server,
        tools=TOOLS,
        tool_choice=NAMED,
        parallel_tool_calls=False,
        n=2,
        temperature=0.8,
        seed=3,
    )
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls", choice
        assert len(_check_calls(choice.message, {"get_weather"})) == 1


class Weather(BaseModel):
    """The forecast for a city."""

    city: str = Field(max_length=24)
    unit: Literal["celsius", "fahrenheit"]


def test_openai_parse_helpers_read_a_pydantic_tool(server):
    client = server.client()
    tool = openai.pydantic_function_tool(Weather)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(
        model=server.model_name,
        messages=MESSAGES,
        tools=[tool],
        tool_choice={"type": "function", "function": {"name": "Weather"}},
        **GREEDY,
    )
    (call,) = r.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, Weather)
    assert r.choices[0].finish_reason == "tool_calls"


def test_auto_is_well_formed(server):
    r = _create(server, tools=TOOLS, tool_choice="auto", max_tokens=64)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in choice.message.tool_calls:
            json.loads(call.function.arguments)  # arguments are JSON text
    else:
        assert isinstance(choice.message.content, str)
    content, calls, finish = _stream(server, tools=TOOLS, tool_choice="auto", max_tokens=64)
    assert finish == choice.finish_reason
    assert calls == [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []
    ]
    assert content == (choice.message.content or "")


def test_a_conversation_with_past_calls_and_results(server):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {
                        "name": "get_weather",
                        "arguments": '{"city": "Paris", "unit": "celsius", "days": 1}',
                    },
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C and sunny"},
    ]
    r = server.client().chat.completions.create(
        model=server.model_name, messages=history, tools=TOOLS, max_tokens=16
    )
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_response_format_with_forced_calls_is_400(server):
    with pytest.raises(openai.BadRequestError) as exc:
        _create(
            server, tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}
        )
    assert exc.value.body["param"] == "tool_choice"
