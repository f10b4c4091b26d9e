"""What the API hands the engine, and what the engine streams back per request."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.step_types import SamplingParams, TokenLogprobs


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


@dataclass
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


def merge_deltas(deltas: list[OutputDelta]) -> OutputDelta:
    """One delta saying what ``deltas`` said in order (counts and status from the last)."""
    last = deltas[-1]

    def joined(field: str) -> list | None:
        parts = [getattr(d, field) for d in deltas]
        return None if all(p is None for p in parts) else [x for p in parts for x in p or ()]

    return OutputDelta(
        request_id=last.request_id, text="".join(d.text for d in deltas),
        token_ids=[t for d in deltas for t in d.token_ids], logprobs=joined("logprobs"),
        prompt_logprobs=joined("prompt_logprobs"), finished=last.finished,
        finish_reason=last.finish_reason, num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens, num_cached_tokens=last.num_cached_tokens,
        error=last.error)
