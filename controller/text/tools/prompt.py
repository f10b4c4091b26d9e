"""A conversation with tools made ready for a chat template that may not know about them.

A template that renders `tools` gets them as they are. One that does not (the default
model's) gets the format's system prompt listing them, merged into the first system message.
Likewise, past calls (an assistant message's `tool_calls`) and their results (`tool` role
messages) are written in the format's own text when the template does not render them.
"""

from __future__ import annotations

import json
from typing import Any

from controller.text.tools.base import ToolCallFormat, tool_functions

_SYSTEM_ROLES = ("system", "developer")


def template_renders_tools(template: str | None) -> bool:
    """Whether a chat template uses the `tools` variable."""
    return bool(template) and "tools" in template


def template_renders_calls(template: str | None) -> bool:
    """Whether a chat template renders assistant `tool_calls` (and then tool results)."""
    return bool(template) and "tool_calls" in template


def _arguments(value: Any) -> Any:
    """A history call's arguments: OpenAI sends JSON text; kept as text when it is not JSON."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _calls_message(fmt: ToolCallFormat, message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message whose `tool_calls` are written into its content."""
    calls = []
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {}) if isinstance(call, dict) else {}
        calls.append((str(fn.get("name", "")), _arguments(fn.get("arguments", {}))))
    text = fmt.call_text(calls) if calls else ""
    content = message.get("content") or ""
    if isinstance(content, list):
        content = "\n".join(p.get("text", "") for p in content if isinstance(p, dict))
    out = {k: v for k, v in message.items() if k != "tool_calls"}
    out["content"] = f"{content}\n{text}" if content and text else content or text
    return out


def history_for_template(
    fmt: ToolCallFormat, messages: list[dict[str, Any]], template: str | None
) -> list[dict[str, Any]]:
    """The messages with past calls and results in the format's text, unless the template
    renders them itself."""
    if template_renders_calls(template):
        return messages
    out = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls"):
            out.append(_calls_message(fmt, m))
        elif m.get("role") == "tool":
            out.append(fmt.tool_result_message(m))
        else:
            out.append(m)
    return out


def with_tool_prompt(
    fmt: ToolCallFormat, messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The messages with the format's system prompt listing `tools` (OpenAI entries), merged
    after the text of a leading system message."""
    prompt = fmt.system_prompt(tool_functions(tools))
    if messages and messages[0].get("role") in _SYSTEM_ROLES:
        first = messages[0].get("content") or ""
        if isinstance(first, list):
            first = "\n".join(p.get("text", "") for p in first if isinstance(p, dict))
        merged = {**messages[0], "content": f"{first}\n\n{prompt}" if first else prompt}
        return [merged, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def prepare_conversation(
    fmt: ToolCallFormat,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template: str | None,
) -> list[dict[str, Any]]:
    """The messages a template is given: history in the format's text where needed, and the
    tools' system prompt when there are tools to show and the template does not show them."""
    out = history_for_template(fmt, messages, template)
    if tools and not template_renders_tools(template):
        out = with_tool_prompt(fmt, out, tools)
    return out
