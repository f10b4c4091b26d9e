"""What a model family's tool-call format is: how tools and past calls are shown to the model,
the grammar its calls follow, and how its output is read back into calls.

How a new model family's format is added:

1. Subclass `ToolCallFormat` in a module of this package (one per family): set `name` (what
   `--tool-call-parser` selects it by), the tags that delimit a call block, and implement
   `system_prompt` (the family's training wording, used when its chat template does not render
   `tools`), `call_text` (calls written as the model writes them), `grammar` (the Lark text
   llguidance compiles for tool_choice required / named; `lark.py` has the pieces) and, if a
   block's body is not JSON call objects, `parse_body`.
2. Register it in `FORMATS` (`__init__.py`) and among the `tool_call_parser` setting's
   choices (controller/settings.py), and, if it can be recognized from a chat template, in
   `detect_format`.
3. Test it as tests/controller/text/test_tool_formats.py does the others: parser, incremental
   parser over every split, rendering, grammar against real token ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call read from the output."""

    name: str  # the function's name
    arguments: str  # its arguments, a JSON object as compact text


@dataclass(frozen=True)
class ParsedOutput:
    """A finished output split into text and calls."""

    content: str | None  # the text outside call blocks, stripped; None when only calls
    calls: list[ToolCall]  # the calls, in output order


def tool_functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The `function` objects of OpenAI `tools` entries (name, description, parameters)."""
    return [t["function"] for t in tools if isinstance(t, dict) and "function" in t]


def arguments_text(arguments: Any) -> str:
    """Arguments as the API returns them: a JSON object as text (one canonical spelling, so
    whole and streamed parsing agree)."""
    return json.dumps(arguments, ensure_ascii=False, separators=(",", ":"))


def call_object_text(name: str, arguments: Any) -> str:
    """One call object as the grammars write it: `{"name": "f", "arguments": {...}}` with
    compact arguments (the history's calls look like the constrained model's)."""
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + arguments_text(arguments) + "}"


def _call_of(item: Any) -> ToolCall | None:
    """A call object `{"name": ..., "arguments": {...}}`, or None when it is not one."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    args = item.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(item["name"], arguments_text(args))


class ToolCallFormat:
    """A model family's tool-call format (see the module docstring for adding one).

    Calls are written in blocks between `start_tag` and `end_tag`; a block's body is one call
    object or a JSON list of them."""

    name = ""  # the --tool-call-parser name
    start_tag = "<tool_call>"  # opens a block of calls
    end_tag = "</tool_call>"  # closes it

    def system_prompt(self, tools: list[dict[str, Any]]) -> str:
        """The system text that shows `tools` to the model, in its training wording."""
        raise NotImplementedError

    def call_text(self, calls: list[tuple[str, dict[str, Any]]]) -> str:
        """(name, arguments) calls written as the model writes them (for the history)."""
        raise NotImplementedError

    def grammar(self, functions: list[dict[str, Any]], parallel: bool) -> str:
        """The Lark grammar (llguidance) of an output that is only calls of `functions`:
        one call, or several when `parallel`."""
        raise NotImplementedError

    def parse_body(self, body: str) -> list[ToolCall] | None:
        """The calls of one block's body; None when it is not valid calls (then the block
        stays in the content)."""
        try:
            value = json.loads(body)
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [_call_of(item) for item in items]
        return None if any(c is None for c in calls) else calls

    def tool_result_message(self, message: dict[str, Any]) -> dict[str, Any]:
        """A `tool` role message for a template that does not render tool results: the
        result as a user turn in a <tool_response> block."""
        content = message.get("content") or ""
        if isinstance(content, list):
            content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
