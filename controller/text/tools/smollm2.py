"""SmolLM2's tool calls: the tools listed in the system prompt inside <tools>...</tools>, and
every call of one answer in one block, `<tool_call>[{"name": ..., "arguments": {...}}, ...]
</tool_call>` (the wording of its function-calling training data; its chat template does not
render tools, so Tandem writes this system prompt)."""

from __future__ import annotations

import json
from typing import Any

from controller.text.tools.base import ToolCallFormat, call_object_text
from controller.text.tools.lark import call_rules, literal

_PROMPT = """You are an expert in composing functions. You are given a question and a set of \
possible functions. Based on the question, you will need to make one or more function/tool \
calls to achieve the purpose. If none of the functions can be used, point it out and refuse to \
answer. If the given question lacks the parameters required by the function, also point it out.

You have access to the following tools:
<tools>{tools}</tools>

The output MUST strictly adhere to the following format, and NO other text MUST be included.
The example format is as follows. Please make sure the parameter type is correct. If no \
function call is needed, please make the tool calls an empty list '[]'.
<tool_call>[
{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},
... (more tool calls as required)
]</tool_call>"""


class SmolLM2Format(ToolCallFormat):
    """SmolLM2 (the default model): one block holding a JSON list of calls."""

    name = "smollm2"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        return _PROMPT.format(tools=json.dumps(tools, ensure_ascii=False))

    def call_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        items = ", ".join(call_object_text(name, args) for name, args in calls)
        return f"{self.start_tag}[{items}]{self.end_tag}"

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        more = f" ({literal(', ')} call)*" if parallel else ""
        start = f"start: {literal(self.start_tag + '[')} call{more} {literal(']' + self.end_tag)}"
        return start + "\n" + call_rules(functions)
