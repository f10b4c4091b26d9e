"""From a request's parameters to its constraints, without compiling: which parameter wins,
which tools get constrained, and the settings that bound grammars."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from controller.api.constraints import forced_functions, grammar_limits, output_constraint
from controller.api.errors import APIError
from controller.api.structured import ChatTool, NamedToolChoice, ResponseFormat, StructuredOutputs
from controller.settings import ControllerConfig
from controller.text.grammar import GrammarLimits


def test_settings_become_grammar_limits():
    config = ControllerConfig(model="m", max_grammar_chars=99, grammar_cache_mib=3)
    assert grammar_limits(config) == GrammarLimits(max_chars=99, cache_bytes=3 << 20)
    assert grammar_limits(ControllerConfig(model="m")) == GrammarLimits()
    assert grammar_limits(SimpleNamespace(model="m")) == GrammarLimits()


def test_output_constraint():
    fmt = ResponseFormat.model_validate
    so = StructuredOutputs.model_validate
    assert output_constraint(None, None) is None
    assert output_constraint(fmt({"type": "text"}), None) is None
    c, param = output_constraint(fmt({"type": "json_object"}), None)
    assert (c.kind, c.spec, param) == ("json_object", "", "response_format")
    schema = {"type": "object", "properties": {"b": {}, "a": {}}}
    c, param = output_constraint(
        fmt({"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}), None
    )
    assert c.kind == "json_schema" and param == "response_format.json_schema.schema"
    assert c.spec.index('"b"') < c.spec.index('"a"')  # the schema's order is the output's
    c, param = output_constraint(fmt({"type": "text"}), so({"choice": ["x"]}))
    assert (c.kind, param) == ("choice", "structured_outputs.choice")
    assert output_constraint(None, so({"json": '{"type": "string"}'}))[0].kind == "json_schema"
    with pytest.raises(APIError) as exc:
        output_constraint(fmt({"type": "json_object"}), so({"regex": "a"}))
    assert exc.value.param == "structured_outputs"


def _tools(*names: str, strict: tuple[str, ...] = ()) -> list[ChatTool]:
    return [
        ChatTool.model_validate(
            {"type": "function", "function": {"name": n, "strict": n in strict}}
        )
        for n in names
    ]


def test_forced_functions():
    tools = _tools("a", "b", "c", strict=("c",))
    named = NamedToolChoice.model_validate({"type": "function", "function": {"name": "b"}})
    names = lambda choice: [fn["name"] for _, fn in forced_functions(tools, choice)]  # noqa: E731
    assert names("required") == ["a", "b", "c"]
    assert names(named) == ["b"]
    assert names("auto") == names(None) == names("none") == []  # strict is not enforced
    (index, fn), *_ = forced_functions(tools, "required")
    assert index == 0 and "parameters" not in fn
    with pytest.raises(APIError):
        forced_functions([], "required")
    other = NamedToolChoice.model_validate({"type": "function", "function": {"name": "z"}})
    with pytest.raises(APIError):
        forced_functions(tools, other)


def test_tool_count_is_bounded_before_pydantic_types_each():
    from pydantic import ValidationError

    from controller.api.protocol import MAX_TOOLS, ChatCompletionRequest

    body = {"messages": [{"role": "user", "content": "x"}]}
    with pytest.raises(ValidationError) as exc:
        ChatCompletionRequest.model_validate({**body, "tools": [{"function": 7}] * (MAX_TOOLS + 1)})
    assert exc.value.error_count() == 1
