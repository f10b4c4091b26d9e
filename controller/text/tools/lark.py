"""Pieces of the Lark grammars (llguidance's dialect) that tool-call formats are made of:
a call object `{"name": "f", "arguments": <JSON of f's parameters schema>}` per function."""

from __future__ import annotations

import json
from typing import Any

# Compact JSON in the arguments: small models loop on free whitespace (as for response_format).
_JSON_OPTIONS = {"whitespace_flexible": False}


def literal(text: str) -> str:
    """`text` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def parameters_schema(function: dict[str, Any]) -> dict[str, Any]:
    """A function's arguments schema with llguidance's options; no `parameters` (or an empty
    schema): any JSON object."""
    schema = function.get("parameters") or {"type": "object"}
    if not isinstance(schema, dict):
        return {"type": "object"}
    return {**schema, "x-guidance": _JSON_OPTIONS}


def call_rules(functions: list[dict[str, Any]]) -> str:
    """Rules `call` (any one of `functions` called) and, per function i, `call_i` and its
    arguments `args_i` as inline `%json`."""
    names = " | ".join(f"call_{i}" for i in range(len(functions)))
    lines = [f"call: {names}"]
    for i, fn in enumerate(functions):
        head = literal('{"name": ' + json.dumps(fn["name"]) + ', "arguments": ')
        lines.append(f'call_{i}: {head} args_{i} "}}"')
        schema = json.dumps(parameters_schema(fn), ensure_ascii=False, separators=(",", ":"))
        lines.append(f"args_{i}: %json {schema}")
    return "\n".join(lines) + "\n"
