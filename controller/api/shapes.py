"""Cheap checks of a raw JSON value's shape, run before pydantic validates it item by item.

Pydantic validates a union member by member and reports every failing item of a list, so a
long list of the wrong shape costs a validation error per item per member (300,000 one-token
prompts with one bad item: 1.5 s and hundreds of MB). These checks look at the raw value once,
stop at the first bad item, and never quote the client's input.
"""

from __future__ import annotations

from typing import Any


def _is_int(value: Any) -> bool:
    return type(value) is int  # bool is an int subclass, and no token id


def check_prompt_shape(value: Any, max_prompts: int, max_ids: int) -> Any:
    """A completion prompt: a text, a list of texts, a list of token ids or a list of token id
    lists, with at most `max_prompts` prompts and `max_ids` token ids in all. Returns the value
    unchanged, or raises ValueError (pydantic answers 400 naming `prompt`)."""
    if not isinstance(value, list) or not value:
        return value  # a text, or a shape pydantic refuses on its own
    first = value[0]
    if _is_int(first):
        if len(value) > max_ids:
            raise ValueError(f"at most {max_ids} token ids")
        if not all(_is_int(t) for t in value):
            raise ValueError("a token id list holds only integers")
        return value
    if len(value) > max_prompts:
        raise ValueError(f"at most {max_prompts} prompts")
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in value):
            raise ValueError("a list of prompts holds only texts, or only token id lists")
        return value
    if isinstance(first, list):
        total = 0
        for prompt in value:
            if not isinstance(prompt, list) or not all(_is_int(t) for t in prompt):
                raise ValueError("a list of token id lists holds only lists of integers")
            total += len(prompt)
            if total > max_ids:
                raise ValueError(f"at most {max_ids} token ids")
        return value
    return value
