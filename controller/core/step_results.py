"""Applying an executor's step result to the requests of the default scheduler.

A result comes in one of two forms (see `StepOutput.sampled_token_ids`): packed, every
request's sampled token in the step's order with a message only for requests that have more to
say (logprobs, prompt logprobs, an error), or one message per request. The packed form without
messages is every plain decode step: `apply_tokens` handles it with no object per request but
the update it returns. Both forms apply the same rules (`Scheduler.update_from_output`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple

from common.wire.step_types import RequestStepOutput, StepInput, StepOutput
from controller.core.output_grammar import advance
from controller.core.request import FinishReason, Request, RequestStatus
from controller.core.scheduler_base import RequestUpdate

#: Ends a request whose result finished it (the scheduler's, bound to it).
Finisher = Callable[[Request, FinishReason], None]

_RUNNING = RequestStatus.RUNNING


class Scheduled(NamedTuple):
    """What a step in flight does for one request. The scheduler's decode loop builds plain
    tuples of this shape (a NamedTuple's constructor is a Python call, once per request per
    step); the class names the fields."""

    request: Request  # the request object scheduled (a later one with its id is another)
    start: int  # the request's num_computed_tokens before the step
    samples: bool  # the step samples the request's next token (a placeholder until received)
    epoch: int  # the request's num_preemptions when scheduled (a later preemption voids it)


def _step_ids(step: StepInput) -> list[str]:
    """The step's request ids in the order of its result's packed tokens."""
    ids = [r.request_id for r in step.new_requests]
    ids += [r.request_id for r in step.cached_requests]
    return ids


def apply_tokens(
    step: StepInput, tokens: list[int], plan: dict[str, Scheduled], finish: Finisher
) -> tuple[list[RequestUpdate], int]:
    """Apply a packed result with no per-request message: (updates, requests finished).

    Per request: the placeholder becomes the token, and the stop rules run only when the token
    could end it (`Request.stop_set`, max_tokens, max_model_len); `Request.check_stop` decides.
    """
    updates: list[RequestUpdate] = []
    num_finished = 0
    get = plan.get
    for rid, token in zip(_step_ids(step), tokens):
        entry = get(rid)
        if entry is None:
            continue  # not part of this step
        request, _, samples, epoch = entry
        if not samples or request.status is not _RUNNING or request.num_preemptions != epoch:
            continue  # a chunk that samples nothing; or finished or preempted meanwhile
        request.num_pending_tokens -= 1
        if token < 0:
            update = RequestUpdate(rid, [], True, "error", error="the executor sampled nothing")
        else:
            output = request.output_token_ids
            output.append(token)
            num_output = len(output)
            reason = error = None
            if (
                token in request.stop_set
                or num_output >= request.max_tokens
                or 0 < request.max_model_len <= len(request.prompt_token_ids) + num_output
            ):
                reason = request.check_stop()
            if request.grammar is not None and reason is None:
                reason, error = advance(request, token)
            update = RequestUpdate(rid, [token], reason is not None, reason)
            if error:  # (a keyword argument costs every update)
                update.error = error
        if update.finished:
            finish(request, update.finish_reason)  # type: ignore[arg-type]
            num_finished += 1
        updates.append(update)
    return updates, num_finished


def apply_outputs(
    step: StepInput, output: StepOutput, plan: dict[str, Scheduled], finish: Finisher
) -> tuple[list[RequestUpdate], int]:
    """Apply a result of either form, per-request messages included: (updates, requests
    finished)."""
    updates: list[RequestUpdate] = []
    num_finished = 0
    for request_id, token, out in _results(step, output):
        entry = plan.get(request_id)
        if entry is None:
            continue  # not part of this step
        request, start, samples, epoch = entry
        if request.status is not _RUNNING or epoch != request.num_preemptions:
            continue  # finished, aborted or preempted meanwhile
        update = RequestUpdate(request_id)
        if out is not None:
            update.prompt_logprobs = out.prompt_logprobs
        if out is not None and out.error:
            update.finish_reason, update.error = "error", out.error
            request.num_computed_tokens = start  # its KV from here is not trusted
        elif samples:
            request.num_pending_tokens -= 1
            if token is None:
                update.finish_reason, update.error = "error", "the executor sampled nothing"
            else:
                request.output_token_ids.append(token)
                update.new_token_ids = [token]
                if out is not None and out.logprobs is not None:
                    update.logprobs = [out.logprobs]
                update.finish_reason = request.check_stop()
                if request.grammar is not None and update.finish_reason is None:
                    update.finish_reason, update.error = advance(request, token)
        if update.finish_reason is not None:
            finish(request, update.finish_reason)
            update.finished = True
            num_finished += 1
        if update.new_token_ids or update.prompt_logprobs or update.finished:
            updates.append(update)
    return updates, num_finished


def _results(
    step: StepInput, output: StepOutput
) -> Iterator[tuple[str, int | None, RequestStepOutput | None]]:
    """(request id, sampled token or None, its full output if it has one) per request of the
    step, from either form of StepOutput (see its sampled_token_ids)."""
    if output.sampled_token_ids is None:
        for out in output.outputs:
            yield out.request_id, out.sampled_token_id, out
        return
    extras = {out.request_id: out for out in output.outputs}
    for request_id, token in zip(_step_ids(step), output.sampled_token_ids):
        out = extras.get(request_id) if extras else None
        if out is not None:
            yield request_id, out.sampled_token_id, out
        else:
            yield request_id, (None if token < 0 else token), None
