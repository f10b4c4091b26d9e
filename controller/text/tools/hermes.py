"""Hermes' tool calls (Qwen2.5, Hermes 2/3 and the models trained on their format): one block
per call, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, blocks separated by
a newline. These models' chat templates render the tools themselves; the system prompt here is
for a template that does not."""

from __future__ import annotations

import json
from typing import Any

from controller.text.tools.base import ToolCallFormat, call_object_text
from controller.text.tools.lark import call_rules, literal

_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


class HermesFormat(ToolCallFormat):
    """Hermes / Qwen2.5: one block per call."""

    name = "hermes"

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        lines = "\n".join(
            json.dumps({"type": "function", "function": t}, ensure_ascii=False) for t in tools
        )
        return _PROMPT.format(tools=lines)

    def call_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        blocks = [
            f"{self.start_tag}\n{call_object_text(name, args)}\n{self.end_tag}"
            for name, args in calls
        ]
        return "\n".join(blocks)

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        block = f"{literal(self.start_tag + chr(10))} call {literal(chr(10) + self.end_tag)}"
        more = ' ("\\n" block)*' if parallel else ""
        return f"start: block{more}\nblock: {block}\n" + call_rules(functions)
