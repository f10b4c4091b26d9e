"""Tool calls in chat responses: the output read by the request's tool-call format into
`message.tool_calls` (whole) or `delta.tool_calls` (streamed, OpenAI's incremental form).

A streamed call is sent when its block closes, as two chunks: its index, id, type and name with
arguments "", then its arguments whole. Both paths read the output with the same rules
(controller/text/tools/parsing.py), so they assemble to the same calls.
"""

from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from controller.api.structured import NamedToolChoice
from controller.text.tools import IncrementalParser, ToolCall, ToolCallFormat, parse_output

_ID_CHARS = string.ascii_letters + string.digits
_ID_LENGTH = 24  # characters after "call_", as OpenAI's ids


def new_call_id() -> str:
    """A fresh tool-call id, `call_` and 24 random letters and digits."""
    return "call_" + "".join(secrets.choice(_ID_CHARS) for _ in range(_ID_LENGTH))


def _ended_by_calls(finish_reason: str | None, called: bool) -> str | None:
    """OpenAI's finish reason: "tool_calls" when calls were returned and the output ended by
    itself ("stop"); a length or abort stays what it was."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


@dataclass(frozen=True)
class ToolPolicy:
    """How a chat request's output is read for tool calls."""

    fmt: ToolCallFormat  # the model's tool-call format
    max_calls: int | None  # 1 when parallel_tool_calls is false; None: no bound

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished output, and its finish reason."""
        parsed = parse_output(self.fmt, text, self.max_calls)
        msg: dict = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            msg["tool_calls"] = [_call_entry(c, new_call_id()) for c in parsed.calls]
        return msg, _ended_by_calls(finish_reason, bool(parsed.calls))


def tool_policy(
    fmt: ToolCallFormat,
    tools: list | None,
    choice: str | NamedToolChoice | None,
    parallel: bool | None,
) -> ToolPolicy | None:
    """The request's policy; None when its output is plain text (no tools, or "none")."""
    if not tools or choice == "none":
        return None
    return ToolPolicy(fmt, 1 if parallel is False else None)


def _call_entry(call: ToolCall, call_id: str) -> dict:
    return {
        "id": call_id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class ToolStream:
    """The streamed output of a response's choices, read for calls."""

    policy: ToolPolicy  # how the output is read
    _parsers: dict[int, IncrementalParser] = field(default_factory=dict)  # per choice index

    def _parser(self, index: int) -> IncrementalParser:
        if index not in self._parsers:
            self._parsers[index] = IncrementalParser(self.policy.fmt, self.policy.max_calls)
        return self._parsers[index]

    def deltas(self, index: int, text: str, finished: bool) -> list[dict]:
        """The `delta` objects one piece of choice `index`'s output makes: its content, then
        two per call completed."""
        parser = self._parser(index)
        first = parser.num_calls
        part = parser.feed(text)
        if finished:
            rest = parser.finish()
            part.content += rest.content
            part.calls.extend(rest.calls)
        out = [{"content": part.content}] if part.content else []
        for k, call in enumerate(part.calls, start=first):
            head = _call_entry(ToolCall(call.name, ""), new_call_id())
            out.append({"tool_calls": [{"index": k, **head}]})
            out.append({"tool_calls": [{"index": k, "function": {"arguments": call.arguments}}]})
        return out

    def finish_reason(self, index: int, finish_reason: str | None) -> str | None:
        """Choice `index`'s finish reason, "tool_calls" when it ended by itself with calls."""
        return _ended_by_calls(finish_reason, self._parser(index).num_calls > 0)
