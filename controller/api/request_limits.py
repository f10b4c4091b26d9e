"""What one request may ask for, checked on the parsed body before anything is built for it.

Every size a client chooses is bounded here (or by the pydantic models of protocol.py, which
run first, or by the body size before parsing), so that the memory and time a request costs
are linear in limits the operator set, never in what the client sent. Each violation is a 400
naming the parameter; no message quotes the client's text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from controller.api.errors import APIError


@dataclass(frozen=True)
class RequestLimits:
    """The bounds on one request (settings of the "request limits" group)."""

    max_sequences: int = 1024  # prompts x n
    max_prompt_tokens: int = 1 << 20  # prompt tokens of all prompts together
    max_stop_strings: int = 16  # stop strings
    max_stop_string_chars: int = 1024  # characters of the longest stop string
    max_stop_token_ids: int = 256  # stop_token_ids
    max_chat_messages: int = 4096  # messages of a chat request
    max_tools: int = 128  # tools of a chat request
    max_logprobs: int = 20  # logprobs / top_logprobs
    stream_stall_timeout: float = 30.0  # seconds a response waits for a client reading nothing

    @classmethod
    def from_config(cls, config: Any, max_logprobs: int) -> RequestLimits:
        """The limits of a controller's settings (the defaults for settings it lacks)."""
        d = cls()

        def get(name: str, default: float) -> Any:
            value = getattr(config, name, None)
            number = isinstance(value, int | float) and not isinstance(value, bool)
            return value if number else default

        return cls(
            max_sequences=get("max_request_sequences", d.max_sequences),
            max_prompt_tokens=get("max_request_prompt_tokens", d.max_prompt_tokens),
            max_stop_strings=get("max_stop_strings", d.max_stop_strings),
            max_stop_string_chars=get("max_stop_string_chars", d.max_stop_string_chars),
            max_stop_token_ids=get("max_stop_token_ids", d.max_stop_token_ids),
            max_chat_messages=get("max_chat_messages", d.max_chat_messages),
            max_tools=get("max_tools", d.max_tools),
            max_logprobs=max_logprobs,
            stream_stall_timeout=get("stream_stall_timeout", d.stream_stall_timeout),
        )


def check_sequences(num_prompts: int, n: int, limit: int) -> None:
    """At most `limit` sequences (prompts x n)."""
    count = num_prompts * n
    if count > limit:
        raise APIError(
            f"The request holds {count} sequences (prompts x n); at most {limit} are allowed.",
            400,
            "n" if num_prompts == 1 else "prompt",
            "too_many_sequences",
        )


def check_stop(stop: str | list[str] | None, limits: RequestLimits) -> list[str]:
    """The stop strings, bounded in count and length."""
    items = [stop] if isinstance(stop, str) else list(stop or [])
    if len(items) > limits.max_stop_strings:
        raise APIError(f"stop: at most {limits.max_stop_strings} stop strings", 400, "stop")
    longest = max(map(len, items), default=0)
    if longest > limits.max_stop_string_chars:
        raise APIError(
            f"stop: a stop string may have at most {limits.max_stop_string_chars} characters "
            f"(one has {longest})",
            400,
            "stop",
        )
    return items


def check_token_ids(ids: Sequence[int], vocab_size: int, param: str) -> None:
    """Every id in the vocabulary (and so in an int32 field of the executor protocol)."""
    if any(t < 0 or t >= vocab_size for t in ids):
        raise APIError(f"{param} holds token ids outside [0, {vocab_size})", 400, param)


def check_stop_token_ids(ids: list[int] | None, limits: RequestLimits, vocab: int) -> list[int]:
    """The stop token ids, bounded in count and in the vocabulary."""
    ids = list(ids or [])
    if len(ids) > limits.max_stop_token_ids:
        raise APIError(
            f"stop_token_ids: at most {limits.max_stop_token_ids} ids", 400, "stop_token_ids"
        )
    check_token_ids(ids, vocab, "stop_token_ids")
    return ids


def check_logprobs(k: int | None, param: str, limits: RequestLimits) -> None:
    """At most --max-logprobs alternatives per position."""
    if k is not None and k > limits.max_logprobs:
        raise APIError(f"{param} must be at most {limits.max_logprobs}", 400, param)


def check_text_length(chars: int, limit: int | None, tokens: int, param: str) -> None:
    """Refuse text longer than `tokens` tokens can cover (`limit` characters), before it is
    tokenized. None: the tokenizer allows no such bound."""
    if limit is not None and chars > limit:
        raise APIError(
            f"{param}: the text has {chars} characters, more than {tokens} tokens can hold.",
            400,
            param,
            "context_length_exceeded",
        )


def check_prompt_tokens(token_counts: Sequence[int], limits: RequestLimits, param: str) -> None:
    """At most --max-request-prompt-tokens prompt tokens in all."""
    total = sum(token_counts)
    if total > limits.max_prompt_tokens:
        raise APIError(
            f"The request's prompts hold {total} tokens; at most {limits.max_prompt_tokens} "
            "are allowed.",
            400,
            param,
            "too_many_tokens",
        )


def content_chars(content: str | list[dict[str, Any]] | None) -> int:
    """Characters of a message's content (text, or text parts)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text") or "") for part in content or ())


def check_chat(num_messages: int, tools: list | None, limits: RequestLimits) -> None:
    """At most --max-chat-messages messages and --max-tools tools."""
    if num_messages > limits.max_chat_messages:
        raise APIError(f"messages: at most {limits.max_chat_messages} messages", 400, "messages")
    if tools is not None and len(tools) > limits.max_tools:
        raise APIError(f"tools: at most {limits.max_tools} tools", 400, "tools")
