"""The controller's limits: admission control (how much may wait for an executor) and what one
request may ask for. Part of ControllerConfig (controller/settings.py), kept in a module of its
own because the limits are one concern with many fields."""

from __future__ import annotations

import re

from common.settings import TandemSettings, setting

LIMITS = "limits: admission control and request size"
REQUEST_LIMITS = "request limits: what one request may ask for"
_LIMIT_SPEC = re.compile(r"[^=,]+=\d+(,\d+)?")


def limit_specs(values: list[str]) -> list[str]:
    """KIND=TOKENS[,SEQS] specs from --executor-limits values. A variable or config value may
    hold several at once (tpu=64,8,gpu=512): a comma item with '=' starts the next one."""
    specs: list[str] = []
    for item in ",".join(values).split(",") if values else []:
        if "=" in item or not specs:
            specs.append(item.strip())
        else:
            specs[-1] += "," + item.strip()
    for spec in specs:
        if not _LIMIT_SPEC.fullmatch(spec):
            raise ValueError(f"{spec!r}: expected KIND=TOKENS[,SEQS]")
    return specs


class LimitSettings(TandemSettings):
    """Bounds on what clients and single requests may cost the controller (429 or 400 beyond
    them)."""

    # Admission: bounds on requests waiting for their first token (429 beyond them).
    max_queued_requests: int = setting(
        1024,
        "sequences waiting for their first token, fleet-wide, before new requests get 429 "
        "(0 = no bound)",
        group=LIMITS,
    )
    max_queued_tokens: int = setting(
        1 << 20, "prompt tokens of those sequences before 429 (0 = no bound)", group=LIMITS
    )
    retry_after: int = setting(
        1, "seconds in the Retry-After header of a 429 or a shutdown 503", group=LIMITS
    )
    max_request_bytes: int = setting(
        4 << 20, "largest HTTP request body; larger ones get 413 (0 = no bound)", group=LIMITS
    )

    # Request limits: what one request may ask for, checked on the parsed body before anything
    # is built for it (400 beyond each). vLLM bounds none of these; the defaults are far above
    # what real clients send and keep one request's controller memory in the megabytes.
    max_request_sequences: int = setting(
        1024, "most sequences (prompts x n) in one request", group=REQUEST_LIMITS, ge=1
    )
    max_request_prompt_tokens: int = setting(
        1 << 20,
        "most prompt tokens in one request, all prompts together (text longer than this many "
        "tokens could cover is refused before it is tokenized)",
        group=REQUEST_LIMITS,
        ge=1,
    )
    max_stop_strings: int = setting(16, "most stop strings in one request", group=REQUEST_LIMITS)
    max_stop_string_chars: int = setting(
        1024, "longest stop string, in characters", group=REQUEST_LIMITS, ge=1
    )
    max_stop_token_ids: int = setting(
        256, "most stop_token_ids in one request", group=REQUEST_LIMITS
    )
    max_chat_messages: int = setting(
        4096, "most messages in one chat request", group=REQUEST_LIMITS, ge=1
    )
    max_tools: int = setting(128, "most tools in one chat request", group=REQUEST_LIMITS)
    # Structured output: a constraint's text bounds its compile time (llguidance compiles a
    # realistic schema in milliseconds; the text size is what a client can inflate).
    max_grammar_chars: int = setting(
        64 << 10,
        "longest structured-output constraint (JSON schema, regex, grammar, choices, the "
        "tool-call grammar of tool_choice required or named), in characters",
        group=REQUEST_LIMITS,
        ge=1,
    )
    grammar_cache_entries: int = setting(
        256, "compiled grammars kept for reuse (0 = none)", group=REQUEST_LIMITS, ge=0
    )
    grammar_cache_mib: int = setting(
        64, "estimated MiB of compiled grammars kept for reuse", group=REQUEST_LIMITS, ge=0
    )
    # A client whose socket takes nothing for this long is gone or stalled: its response is
    # aborted and its KV blocks freed, instead of generating into buffers nobody reads.
    stream_stall_timeout: float = setting(
        30.0,
        "seconds a response may wait for a client that reads nothing before it is aborted "
        "(0 = wait for ever)",
        group=REQUEST_LIMITS,
        ge=0,
    )
