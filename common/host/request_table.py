"""The requests an executor holds between steps, and how a step's diff changes them.

Every executor kind keeps the same per-request state (tokens, block table, sampling) and applies
the controller's diff the same way: finished ids dropped first, then new requests taken, then
cached requests advanced. ``RequestTable.apply`` does it once for all of them, checking each
request against the executor's own state and limits (common.host.step_check): a request that
fails a check is rejected alone, its state dropped, and the rest of the step runs.

Pure Python, no torch: the simulator's runner uses it as the torch runners' input batch does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from common.host.step_check import (
    StepLimits,
    block_ids_problem,
    new_request_problem,
    schedule_problem,
    step_problems,
    token_mask_problem,
)
from common.wire.step_types import NewRequestData, SamplingParams, StepInput


@dataclass
class RequestState:
    """What the executor remembers about one request."""

    request_id: str  # the controller's id
    token_ids: list[int]  # prompt followed by every generated token
    num_prompt_tokens: int  # length of the prompt part of token_ids
    block_ids: list[int]  # KV blocks of the request, in sequence order
    sampling: SamplingParams  # how to sample it
    # Structured output: the tokens this step may sample (packed bits, common.wire.step_types.
    # token_mask_bytes), replaced by every step that schedules the request; None = any token.
    allowed_token_mask: bytes | None = None
    # Let go after a failure (a check, non-finite values, a failed step, a reset): a step
    # launched before that and still holding the request reports it unknown.
    dropped: bool = False

    @classmethod
    def from_new(cls, new: NewRequestData) -> RequestState:
        """The state of a request the step sends whole."""
        tokens = list(new.prompt_token_ids) + list(new.output_token_ids)
        return cls(
            new.request_id,
            tokens,
            len(new.prompt_token_ids),
            list(new.block_ids),
            new.sampling,
            new.allowed_token_mask or None,
        )

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        """Generated tokens so far (a copy)."""
        return self.token_ids[self.num_prompt_tokens :]


#: A runnable request of a step: (its state, tokens computed before, tokens to compute now).
Runnable = tuple[RequestState, int, int]


class RequestTable:
    """The requests one executor session holds, by id, and the step diffs that change them."""

    def __init__(
        self,
        limits: StepLimits | None = None,
        make_state: Callable[[NewRequestData], RequestState] = RequestState.from_new,
    ):
        self.limits = limits or StepLimits()  # what a step may ask (set from the handshake)
        self.make_state = make_state  # builds a new request's state (a subclass may add fields)
        self.requests: dict[str, RequestState] = {}  # live requests by id

    def __len__(self) -> int:
        return len(self.requests)

    def clear(self) -> None:
        """Forget every request."""
        for state in self.requests.values():
            state.dropped = True
        self.requests.clear()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Forget these requests after a failure (unknown ids are ignored)."""
        for rid in request_ids:
            self.drop(rid)

    def drop(self, request_id: str) -> None:
        """Forget one request after a failure (no error if unknown)."""
        state = self.requests.pop(request_id, None)
        if state is not None:
            state.dropped = True

    def apply(self, step: StepInput) -> tuple[list[Runnable], dict[str, str]]:
        """Apply the step's diff: the runnable requests in the step's order, and the error of
        each rejected request (its state dropped)."""
        requests, limits = self.requests, self.limits
        for rid in step.finished_request_ids:
            requests.pop(rid, None)
        errors = step_problems(step, limits, requests) if step.num_requests else {}
        runnable: list[Runnable] = []
        for new in step.new_requests:
            rid = new.request_id
            bad = errors.get(rid) or new_request_problem(new, limits)
            if not bad:
                state = self.make_state(new)
                bad = schedule_problem(
                    len(state.token_ids),
                    len(state.block_ids),
                    new.num_computed_tokens,
                    new.num_scheduled_tokens,
                    limits,
                )
            if bad:
                errors[rid] = bad
                self.drop(rid)  # whatever it held under this id is void too
                continue
            requests[rid] = state
            runnable.append((state, new.num_computed_tokens, new.num_scheduled_tokens))
        for cached in step.cached_requests:
            rid = cached.request_id
            state = requests.get(rid)
            bad = errors.get(rid) or ("unknown request" if state is None else "")
            new_blocks = cached.new_block_ids
            if new_blocks and not bad:  # most decode steps bring no block
                bad = block_ids_problem(new_blocks, limits)
            if cached.allowed_token_mask and not bad:  # constrained requests only
                bad = token_mask_problem(cached.allowed_token_mask, limits)
            if not bad:
                blocks = len(state.block_ids) + len(new_blocks)
                bad = schedule_problem(
                    len(state.token_ids),
                    blocks,
                    cached.num_computed_tokens,
                    cached.num_scheduled_tokens,
                    limits,
                )
            if bad:
                errors[rid] = bad
                self.drop(rid)
                continue
            state.block_ids.extend(new_blocks)
            state.allowed_token_mask = cached.allowed_token_mask or None  # this step's, or none
            runnable.append((state, cached.num_computed_tokens, cached.num_scheduled_tokens))
        return runnable, errors
