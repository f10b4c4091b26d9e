"""Tool-call formats of model families: prompt rendering, call grammars, output parsing.

`FORMATS` maps a --tool-call-parser name to its format; `select_format` resolves "auto"
from the model's chat template. base.py says how a new family's format is added."""

from __future__ import annotations

from controller.text.tools.base import ParsedOutput, ToolCall, ToolCallFormat
from controller.text.tools.hermes import HermesFormat
from controller.text.tools.parsing import IncrementalParser, StreamedPart, parse_output
from controller.text.tools.smollm2 import SmolLM2Format

FORMATS: dict[str, type[ToolCallFormat]] = {
    SmolLM2Format.name: SmolLM2Format,
    HermesFormat.name: HermesFormat,
}


def detect_format(chat_template: str | None) -> ToolCallFormat:
    """The format a chat template implies: hermes when it writes <tool_call> blocks itself
    (Qwen2.5, Hermes), else smollm2 (the default model's)."""
    if chat_template and "<tool_call>" in chat_template:
        return HermesFormat()
    return SmolLM2Format()


def select_format(name: str, chat_template: str | None) -> ToolCallFormat:
    """The format named by --tool-call-parser ("auto": from the chat template); ValueError
    for an unknown name."""
    if name == "auto":
        return detect_format(chat_template)
    if name not in FORMATS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: auto, {', '.join(FORMATS)}")
    return FORMATS[name]()


__all__ = [
    "FORMATS",
    "IncrementalParser",
    "ParsedOutput",
    "StreamedPart",
    "ToolCall",
    "ToolCallFormat",
    "detect_format",
    "parse_output",
    "select_format",
]
