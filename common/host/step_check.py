"""What an executor checks in every step before it touches the device: executors trust nothing.

The controller schedules and allocates, but an executor must never let a step it is sent
corrupt its memory, crash its device or fail requests that are not at fault: a bug, a skewed
version or a hostile peer can send anything the wire can carry. Every executor kind (the torch
runners, the TPU runner, the simulator) checks steps through these functions, against its own
limits (``StepLimits``: what it reported in ``InitDevice`` and what ``InitializeCache``
allocated). A check returns why a request cannot run ("" when it can); the caller rejects that
request alone (its ``RequestStepOutput.error``, its state dropped) and runs the rest.

Pure Python, no torch: the simulator uses it too.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Container, Sequence
from dataclasses import dataclass, field

from common.wire.step_types import (
    NewRequestData,
    SamplingParams,
    StepInput,
    allowed_bits,
    token_mask_bytes,
)

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_PENALTY = 2.0  # presence / frequency penalties beyond +-2 are no sampling anyone asked for
_NO_LIMIT = 2**31 - 1  # the largest value an int32 field can carry


@dataclass(frozen=True)
class StepLimits:
    """What one executor accepts in a step (from its handshake answers)."""

    num_blocks: int = _NO_LIMIT  # KV blocks allocated; valid ids are 1 .. num_blocks - 1
    block_size: int = 16  # tokens per KV block
    vocab_size: int = _NO_LIMIT  # valid token ids are 0 .. vocab_size - 1
    max_model_len: int = _NO_LIMIT  # longest sequence (prompt + output)
    max_tokens_per_step: int = _NO_LIMIT  # most tokens in one step (InitDevice's)
    max_num_seqs: int = _NO_LIMIT  # most requests in one step (InitDevice's)
    max_logprobs: int = _NO_LIMIT  # most top logprobs per position
    # The longest block table a request can need: derived once here, read for every request
    # of every step.
    max_blocks_per_request: int = field(init=False)

    def __post_init__(self) -> None:
        blocks = -(-self.max_model_len // self.block_size)
        object.__setattr__(self, "max_blocks_per_request", blocks)  # frozen: set once


def _finite_in(value: float, low: float, high: float) -> bool:
    return math.isfinite(value) and low <= value <= high


def sampling_problem(s: SamplingParams, limits: StepLimits) -> str:
    """Why these sampling parameters cannot be honoured ("" when they can)."""
    if not _finite_in(s.temperature, 0.0, math.inf):
        return f"temperature {s.temperature} is not a finite number >= 0"
    if not _finite_in(s.top_p, 0.0, 1.0):
        return f"top_p {s.top_p} is outside [0, 1]"
    if s.top_k < -1:
        return f"top_k {s.top_k} is below -1"
    if not _finite_in(s.min_p, 0.0, 1.0):
        return f"min_p {s.min_p} is outside [0, 1]"
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(s, name)
        if not _finite_in(value, -MAX_PENALTY, MAX_PENALTY):
            return f"{name} {value} is outside [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    if not (math.isfinite(s.repetition_penalty) and s.repetition_penalty > 0.0):
        return f"repetition_penalty {s.repetition_penalty} is not a finite number > 0"
    if s.seed is not None and not INT64_MIN <= s.seed <= INT64_MAX:
        return "seed is outside the int64 range"
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(s, name)
        if value is not None and not 0 <= value <= limits.max_logprobs:
            return f"{name} {value} is outside [0, {limits.max_logprobs}]"
    if s.min_tokens < 0:
        return f"min_tokens {s.min_tokens} is negative"
    if s.stop_token_ids and not _ids_in_range(s.stop_token_ids, limits.vocab_size):
        return f"a stop token id is outside [0, {limits.vocab_size})"
    return ""


def _ids_in_range(ids: Sequence[int], end: int) -> bool:
    return min(ids) >= 0 and max(ids) < end


def token_mask_problem(mask: bytes | None, limits: StepLimits) -> str:
    """Why a structured-output mask cannot be applied ("" when it can, or when there is none):
    it must hold exactly ``token_mask_bytes(vocab)`` bytes and allow some token below the
    vocabulary size (bits past it are padding and ignored). Checked on the received bytes,
    before the executor builds anything from them. None or empty: no mask (the wire's
    unconstrained request)."""
    if not mask:
        return ""
    expected = token_mask_bytes(limits.vocab_size)
    if len(mask) != expected:
        vocab = limits.vocab_size
        return f"allowed_token_mask holds {len(mask)} bytes, not {expected} (vocab {vocab})"
    if not allowed_bits(mask, limits.vocab_size):  # one big-integer test, no per-token loop
        return "allowed_token_mask allows no token"
    return ""


def block_ids_problem(block_ids: Sequence[int], limits: StepLimits) -> str:
    """Why these block ids cannot be written to ("" when they can). Block 0 is the null block
    padding writes to: a request never owns it."""
    if block_ids and not (min(block_ids) > 0 and max(block_ids) < limits.num_blocks):
        return f"a block id is outside [1, {limits.num_blocks})"
    return ""


def new_request_problem(r: NewRequestData, limits: StepLimits) -> str:
    """Why a new request cannot be taken, from its own data alone ("" when it can)."""
    num_tokens = len(r.prompt_token_ids) + len(r.output_token_ids)
    if not r.request_id:
        return "empty request id"
    if not r.prompt_token_ids:
        return "empty prompt"
    if num_tokens > limits.max_model_len:
        return f"{num_tokens} tokens exceed max_model_len {limits.max_model_len}"
    vocab = limits.vocab_size
    if not _ids_in_range(r.prompt_token_ids, vocab) or (
        r.output_token_ids and not _ids_in_range(r.output_token_ids, vocab)
    ):
        return f"token id outside [0, {vocab})"
    if len(r.block_ids) > limits.max_blocks_per_request:
        return f"{len(r.block_ids)} KV blocks exceed {limits.max_blocks_per_request} per request"
    # Leading blocks wholly before the computation's start may be the null block: a sliding-
    # window model's controller gives back blocks out of the window (they are never written,
    # and attention reads them only masked).
    passed = r.num_computed_tokens // limits.block_size
    owned = [b for b in r.block_ids[:passed] if b != 0] + r.block_ids[passed:]
    return (
        block_ids_problem(owned, limits)
        or sampling_problem(r.sampling, limits)
        or token_mask_problem(r.allowed_token_mask, limits)
    )


def schedule_problem(
    num_known: int, num_blocks: int, computed: int, scheduled: int, limits: StepLimits
) -> str:
    """Why computing ``scheduled`` tokens after ``computed`` of a request that knows
    ``num_known`` tokens and holds ``num_blocks`` blocks cannot run ("" when it can)."""
    end = computed + scheduled
    if scheduled <= 0 or computed < 0:
        return f"bad schedule: {computed} computed, {scheduled} scheduled"
    if scheduled > limits.max_tokens_per_step:
        return f"{scheduled} tokens exceed the step limit {limits.max_tokens_per_step}"
    if end > num_known:
        return f"scheduled up to token {end} but only {num_known} are known"
    if end > limits.max_model_len:
        return f"sequence length {end} exceeds max_model_len {limits.max_model_len}"
    if num_blocks > limits.max_blocks_per_request:
        return f"{num_blocks} KV blocks exceed {limits.max_blocks_per_request} per request"
    needed = -(-end // limits.block_size)
    if needed > num_blocks:
        return f"needs {needed} KV blocks, has {num_blocks}"
    return ""


def step_problems(step: StepInput, limits: StepLimits, known: Container[str]) -> dict[str, str]:
    """Requests of a step rejected by the step as a whole, by id: ids scheduled twice (every
    time), new ids the executor already holds, cached ids it does not hold (``known``: its
    requests once the step's finished ids are dropped), requests past ``max_num_seqs`` and those
    whose tokens would take the step past ``max_tokens_per_step`` (in the step's order)."""
    problems: dict[str, str] = {}
    ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.cached_requests]
    if len(set(ids)) != len(ids):
        for rid, times in Counter(ids).items():
            if times > 1:
                problems[rid] = f"scheduled {times} times in one step"
    for r in step.new_requests:
        if r.request_id in known and r.request_id not in problems:
            problems[r.request_id] = "sent as new but already held (finish it first)"
    for r in step.cached_requests:
        if r.request_id not in known and r.request_id not in problems:
            problems[r.request_id] = "unknown request (never sent, finished or failed)"
    _over_step_limits(step, limits, problems)
    return problems


def _over_step_limits(step: StepInput, limits: StepLimits, problems: dict[str, str]) -> None:
    """Reject the requests past the step's request and token limits (others run)."""
    taken = tokens = 0
    for r in [*step.new_requests, *step.cached_requests]:
        if r.request_id in problems:
            continue
        if taken + 1 > limits.max_num_seqs:
            problems[r.request_id] = f"the step holds more than {limits.max_num_seqs} requests"
        elif tokens + max(r.num_scheduled_tokens, 0) > limits.max_tokens_per_step:
            problems[r.request_id] = f"the step holds more than {limits.max_tokens_per_step} tokens"
        else:
            taken += 1
            tokens += max(r.num_scheduled_tokens, 0)
