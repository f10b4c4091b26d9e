"""Tool-call formats: whole-output parsing, the incremental parser against it at every split
point, prompt and history rendering, and the call grammars over the default model's tokens."""

from __future__ import annotations

import json

import pytest

from controller.text.grammar import Constraint, GrammarCompiler
from controller.text.tokenizer import Tokenizer
from controller.text.tools import (
    FORMATS,
    IncrementalParser,
    ToolCall,
    parse_output,
    select_format,
)
from controller.text.tools.hermes import HermesFormat
from controller.text.tools.prompt import prepare_conversation
from controller.text.tools.smollm2 import SmolLM2Format

WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"enum": ["c", "f"]},
            "days": {"type": "integer", "minimum": 1, "maximum": 7},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
NOOP = {"name": "noop"}
FUNCTIONS = [WEATHER, NOOP]

SMOL_OUTPUTS = [
    '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]</tool_call>',
    '<tool_call>[{"name": "get_weather", "arguments": {"city":"Oslo","unit":"f"}}, '
    '{"name": "noop", "arguments": {}}]</tool_call>',
    'Let me check. <tool_call>[\n{"name": "noop", "arguments": "{}"}\n]</tool_call>  ',
    "No tools needed: the answer is 4.",
    '<tool_call>[{"name": "noop", "arguments": {]</tool_call> then text',  # bad JSON: content
    '  <tool_call>[{"name": "noop", "arguments": {}}]',  # never closed: content
    "a < b and <tool_ca",  # a partial tag at the end stays content
    '<tool_call>{"name": "noop", "arguments": {}}</tool_call>\n<tool_call>[]</tool_call>',
    "",
]
HERMES_OUTPUTS = [
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}\n'
    "</tool_call>",
    'Sure.\n<tool_call>\n{"name": "noop", "arguments": {}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Nice", "unit": "f"}}\n'
    "</tool_call>",
    "<tool_call>\nnot json\n</tool_call>",
    "plain answer\n\n",
]


def test_smollm2_parser():
    (content, calls) = _parsed(SmolLM2Format(), SMOL_OUTPUTS[1])
    assert content is None
    assert calls == [
        ToolCall("get_weather", '{"city":"Oslo","unit":"f"}'),
        ToolCall("noop", "{}"),
    ]
    assert _parsed(SmolLM2Format(), SMOL_OUTPUTS[2]) == ("Let me check.", [ToolCall("noop", "{}")])
    assert _parsed(SmolLM2Format(), SMOL_OUTPUTS[3]) == (SMOL_OUTPUTS[3], [])
    assert _parsed(SmolLM2Format(), SMOL_OUTPUTS[4]) == (SMOL_OUTPUTS[4], [])
    assert _parsed(SmolLM2Format(), SMOL_OUTPUTS[5]) == (SMOL_OUTPUTS[5].strip(), [])
    assert _parsed(SmolLM2Format(), SMOL_OUTPUTS[7]) == (None, [ToolCall("noop", "{}")])
    assert _parsed(SmolLM2Format(), "") == ("", [])
    # parallel_tool_calls false: the first call only
    assert parse_output(SmolLM2Format(), SMOL_OUTPUTS[1], max_calls=1).calls == [calls[0]]


def test_hermes_parser():
    assert _parsed(HermesFormat(), HERMES_OUTPUTS[1]) == (
        "Sure.",
        [ToolCall("noop", "{}"), ToolCall("get_weather", '{"city":"Nice","unit":"f"}')],
    )
    assert _parsed(HermesFormat(), HERMES_OUTPUTS[2]) == (HERMES_OUTPUTS[2], [])
    assert _parsed(HermesFormat(), HERMES_OUTPUTS[3]) == ("plain answer", [])


def _parsed(fmt, text, max_calls=None):
    out = parse_output(fmt, text, max_calls)
    return out.content, out.calls


def _streamed(fmt, pieces, max_calls=None):
    parser = IncrementalParser(fmt, max_calls)
    content, calls = "", []
    for piece in pieces:
        part = parser.feed(piece)
        content, calls = content + part.content, calls + part.calls
    part = parser.finish()
    content, calls = content + part.content, calls + part.calls
    return (None if calls and not content else content), calls


CASES = [(SmolLM2Format(), t) for t in SMOL_OUTPUTS] + [(HermesFormat(), t) for t in HERMES_OUTPUTS]


@pytest.mark.parametrize("fmt,text", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("max_calls", [None, 1])
def test_incremental_parser_equals_whole_parser_at_every_split(fmt, text, max_calls):
    whole = _parsed(fmt, text, max_calls)
    for i in range(len(text) + 1):
        for j in range(i, len(text) + 1, 7):
            assert _streamed(fmt, [text[:i], text[i:j], text[j:]], max_calls) == whole, (i, j)
    assert _streamed(fmt, list(text), max_calls) == whole  # character by character


def test_incremental_parser_holds_back_only_a_possible_tag():
    parser = IncrementalParser(SmolLM2Format())
    assert parser.feed("Hello <tool").content == "Hello"
    assert parser.feed("box> there").content == " <toolbox> there"
    assert parser.feed("<tool_call>[]").content == ""
    assert parser.feed("</tool_call>").calls == []


SMOL_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
AWARE_TEMPLATE = "{% if tools %}{{ tools }}{% endif %}{% for m in messages %}{{ m.tool_calls }}"


def test_tools_go_into_the_system_prompt_when_the_template_ignores_them():
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    user = [{"role": "user", "content": "Weather in Paris?"}]
    out = prepare_conversation(SmolLM2Format(), user, tools, SMOL_TEMPLATE)
    assert out[0]["role"] == "system" and out[1:] == user
    listed = out[0]["content"].split("<tools>")[1].split("</tools>")[0]
    assert json.loads(listed) == FUNCTIONS
    assert "<tool_call>[" in out[0]["content"]
    merged = prepare_conversation(
        SmolLM2Format(), [{"role": "system", "content": "Be brief."}, *user], tools, SMOL_TEMPLATE
    )
    assert merged[0]["content"].startswith("Be brief.\n\n") and "<tools>" in merged[0]["content"]
    assert prepare_conversation(SmolLM2Format(), user, tools, AWARE_TEMPLATE) == user
    assert prepare_conversation(SmolLM2Format(), user, None, SMOL_TEMPLATE) == user
    assert "<tools>\n{" in HermesFormat().system_prompt(FUNCTIONS)


HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
]


@pytest.mark.parametrize("fmt", [SmolLM2Format(), HermesFormat()], ids=["smollm2", "hermes"])
def test_history_calls_and_results_are_written_in_the_format(fmt):
    out = prepare_conversation(fmt, HISTORY, None, SMOL_TEMPLATE)
    assert out[0] == HISTORY[0]
    assistant, result = out[1], out[2]
    assert "tool_calls" not in assistant
    assert parse_output(fmt, assistant["content"]).calls == [
        ToolCall("get_weather", '{"city":"Paris","unit":"c"}')
    ]
    assert result == {"role": "user", "content": "<tool_response>\n21 C, sunny\n</tool_response>"}
    assert prepare_conversation(fmt, HISTORY, None, AWARE_TEMPLATE) == HISTORY


def test_the_default_models_template_renders_a_tool_conversation(default_model_dir):
    tok = Tokenizer.from_model_dir(default_model_dir)
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    fmt = select_format("auto", tok.chat_template)
    assert fmt.name == "smollm2"
    messages = prepare_conversation(fmt, HISTORY, tools, tok.get_chat_template(None, tools))
    text = tok.apply_chat_template(messages, tools=tools)
    assert "<tools>" in text and '<tool_call>[{"name": "get_weather"' in text
    assert "<tool_response>" in text and text.endswith("<|im_start|>assistant\n")


def test_format_selection():
    assert select_format("auto", "{{ '<tool_call>' }}").name == "hermes"
    assert select_format("auto", None).name == "smollm2"
    assert {select_format(name, None).name for name in FORMATS} == set(FORMATS)
    with pytest.raises(ValueError):
        select_format("mistral", None)


@pytest.fixture(scope="module")
def accepts(default_model_dir):
    """accepts(grammar, text): the compiled grammar takes text's tokens and may end there."""
    tok = Tokenizer.from_model_dir(default_model_dir)
    compiler = GrammarCompiler.for_tokenizer(tok)

    def check(grammar: str, text: str) -> bool:
        m = compiler.compile(Constraint("grammar", grammar)).matcher()
        return m.accept_all(tok.encode(text, add_special_tokens=False)) and m.can_end()

    return check


@pytest.mark.parametrize("fmt", [SmolLM2Format(), HermesFormat()], ids=["smollm2", "hermes"])
def test_call_grammar_accepts_valid_calls_and_refuses_others(accepts, fmt):
    paris = ("get_weather", {"city": "Paris", "unit": "c"})
    both = fmt.call_text([paris, ("noop", {})])
    parallel, single = fmt.grammar(FUNCTIONS, True), fmt.grammar(FUNCTIONS, False)
    assert accepts(parallel, fmt.call_text([paris]))
    assert accepts(parallel, both)
    assert not accepts(single, both)  # parallel_tool_calls false: one call
    assert accepts(single, fmt.call_text([("noop", {"any": [1]})]))
    bad = [
        [("get_weather", {"city": "Paris"})],  # a required argument missing
        [("get_weather", {"city": "Paris", "unit": "k"})],  # not in the enum
        [("get_weather", {"city": "Paris", "unit": "c", "days": 9})],  # above the maximum
        [("other", {})],  # not a tool
    ]
    for calls in bad:
        assert not accepts(parallel, fmt.call_text(calls)), calls
    named = fmt.grammar([NOOP], True)
    assert not accepts(named, fmt.call_text([paris]))
    assert not accepts(parallel, "Sure! " + fmt.call_text([paris]))  # only calls
