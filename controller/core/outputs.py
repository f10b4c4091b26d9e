"""What the API hands the engine, and what the engine streams back per request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from common.wire.step_types import SamplingParams, TokenLogprobs


@dataclass
class GenerationRequest:
    """One sequence to generate (an API request with n > 1 becomes n of these)."""

    request_id: str  # unique within the controller
    prompt_token_ids: list[int]  # the tokenized prompt
    sampling: SamplingParams  # sampling parameters for the executor
    max_tokens: int  # most tokens to generate
    min_tokens: int = 0  # EOS and stop ids are ignored before this many tokens
    stop: list[str] = field(default_factory=list)  # stop strings (excluded from the text)
    stop_token_ids: list[int] = field(default_factory=list)  # extra ids that stop generation
    ignore_eos: bool = False  # keep generating past EOS
    include_stop_str_in_output: bool = False  # keep the matched stop string in the text
    skip_special_tokens: bool = True  # leave special tokens out of the text
    priority: int = 0  # lower = more urgent (priority scheduling only)
    stream: bool = True  # hand over every step's delta; False: the first, then one at the end
    # The output's compiled constraint (a controller.text.grammar.CompiledGrammar; core
    # imports no text; a forced tool call is one too): each request placed on an executor
    # gets a matcher from it, replayed over the output so far
    # (controller.fleet.tracked.scheduler_request).
    grammar: Any = None


@dataclass(slots=True)  # one per request per step: slots make it cheaper to build and read
class OutputDelta:
    """What one step added to one request, as the API streams it."""

    request_id: str  # the GenerationRequest's id
    text: str = ""  # new text (never a broken UTF-8 character)
    token_ids: list[int] = field(default_factory=list)  # new token ids
    logprobs: list[TokenLogprobs] | None = None  # per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt positions, when asked for
    finished: bool = False  # the request is over
    finish_reason: str | None = None  # stop | length | abort | error
    num_prompt_tokens: int = 0  # prompt length
    num_output_tokens: int = 0  # tokens generated so far
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str = ""  # why the request failed, when finish_reason is "error"


def own_copy(delta: OutputDelta) -> OutputDelta:
    """A copy of `delta` whose lists nobody else holds (one `absorb` may grow). Built field by
    field: `dataclasses.replace` looks the fields up on every call, on the per-token path."""
    d = delta
    return OutputDelta(
        d.request_id,
        d.text,
        list(d.token_ids),
        None if d.logprobs is None else list(d.logprobs),
        None if d.prompt_logprobs is None else list(d.prompt_logprobs),
        d.finished,
        d.finish_reason,
        d.num_prompt_tokens,
        d.num_output_tokens,
        d.num_cached_tokens,
        d.error,
    )


def absorb(into: OutputDelta, later: OutputDelta) -> None:
    """Make ``into`` (a delta whose lists nobody else holds) say what it said and then what
    ``later`` said; counts and status come from ``later``."""
    into.text += later.text
    into.token_ids += later.token_ids
    if later.logprobs:
        if into.logprobs is None:
            into.logprobs = list(later.logprobs)
        else:
            into.logprobs += later.logprobs
    if later.prompt_logprobs:
        if into.prompt_logprobs is None:
            into.prompt_logprobs = list(later.prompt_logprobs)
        else:
            into.prompt_logprobs += later.prompt_logprobs
    into.finished = later.finished
    into.finish_reason = later.finish_reason
    into.error = later.error
    into.num_prompt_tokens = later.num_prompt_tokens
    into.num_output_tokens = later.num_output_tokens
    into.num_cached_tokens = later.num_cached_tokens
