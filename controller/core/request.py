"""Controller-side state of one generation request, and the queue of requests not running.

The scheduler moves a `Request` between its queues and the KV-cache manager hashes its tokens;
neither the prompt nor the generated tokens are ever copied per step.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.wire.step_types import SamplingParams

if TYPE_CHECKING:
    from controller.core.output_grammar import OutputGrammar

FinishReason = str  # why a request ended: "stop" | "length" | "abort" | "error"

FINISH_REASONS: frozenset[str] = frozenset({"stop", "length", "abort", "error"})


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"  # queued, never scheduled yet
    RUNNING = "running"  # admitted: owns KV blocks, the executor holds its state
    PREEMPTED = "preempted"  # evicted by recompute: back in the waiting queue, no blocks
    FINISHED = "finished"  # done (see finish_reason); no blocks, in no queue


@dataclass(eq=False)
class Request:
    """One request as the controller tracks it: what to generate and how far it has got.

    `num_computed_tokens` counts the tokens whose KV is in the cache, or will be once the steps
    already sent have run; each step it catches up with `num_tokens` (prompt plus generated
    tokens) plus `num_pending_tokens` (tokens being sampled by steps in flight: placeholders the
    executor fills from its own samples). Requests compare by identity.
    """

    request_id: str  # unique within the controller
    prompt_token_ids: list[int]  # the tokenized prompt
    sampling: SamplingParams  # how the executor samples the next token
    max_tokens: int  # most tokens to generate
    eos_token_ids: list[int] = field(default_factory=list)  # model EOS ids (unless ignore_eos)
    stop_token_ids: list[int] = field(default_factory=list)  # more ids that end generation
    ignore_eos: bool = False  # keep generating past EOS ids
    min_tokens: int = 0  # EOS / stop ids do not stop generation before this many tokens
    priority: int = 0  # lower value = more urgent (used by the priority policy only)
    arrival_time: float = field(default_factory=time.monotonic)  # monotonic seconds
    max_model_len: int = 0  # stop with "length" once prompt + output reach it; 0 = no limit
    # Structured output: the grammar the output must match, at the output's current position
    # (it advances with each token received); None = free output.
    grammar: OutputGrammar | None = None
    grammar_mask: bytes | None = None  # its allowed next tokens, once computed for this position

    # Mutable state, owned by the scheduler and the KV-cache manager.
    output_token_ids: list[int] = field(default_factory=list)  # generated tokens so far
    num_computed_tokens: int = 0  # tokens whose KV is in the cache (or being computed)
    num_pending_tokens: int = 0  # tokens sampled by steps in flight, not yet received
    status: RequestStatus = RequestStatus.WAITING  # life-cycle state
    finish_reason: FinishReason | None = None  # set once finished
    num_preemptions: int = 0  # times evicted by recompute
    num_cached_tokens: int = 0  # prefix-cache hit, in tokens, when first scheduled
    block_hashes: list[bytes] = field(default_factory=list)  # chained hashes of full blocks
    # Set by the KV-cache manager after each allocation (0 while it holds no blocks): a step
    # that keeps num_computed_tokens + scheduled within `kv_room`, and the known tokens below
    # `kv_hash_limit` (no block newly full to cache), needs no allocation call (the
    # scheduler's decode fast path).
    kv_room: int = 0
    kv_hash_limit: int = 0
    # Every id that may end the request with "stop" (stop ids, and EOS ids unless ignored),
    # set when the scheduler queues it: a sampled token outside it, below max_tokens and
    # max_model_len, needs no `check_stop` call.
    stop_set: frozenset[int] = frozenset()

    @property
    def num_prompt_tokens(self) -> int:
        """Length of the prompt."""
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far."""
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt followed by the generated tokens (a new list)."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        """Whether the request has ended."""
        return self.status is RequestStatus.FINISHED

    @property
    def can_sample_more(self) -> bool:
        """Whether one more token may be sampled beyond those in flight (max_tokens and
        max_model_len; a stop id in flight is not known yet)."""
        sampled = len(self.output_token_ids) + self.num_pending_tokens
        if sampled >= self.max_tokens:
            return False
        return (
            self.max_model_len <= 0
            or self.num_tokens + self.num_pending_tokens < self.max_model_len
        )

    def token_ids_between(self, start: int, end: int) -> list[int]:
        """Tokens at positions [start, end) of prompt + output, without joining the two lists."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def check_stop(self) -> FinishReason | None:
        """Whether the last generated token ends the request, and why (None = keep going).

        A stop or EOS id ends it with "stop" once `min_tokens` are generated (the stop token is
        kept in `output_token_ids`); reaching `max_tokens` or `max_model_len` ends it with
        "length".
        """
        num_output = len(self.output_token_ids)
        if num_output == 0:
            return None
        if num_output >= self.min_tokens:
            last = self.output_token_ids[-1]
            if last in self.stop_token_ids or (not self.ignore_eos and last in self.eos_token_ids):
                return "stop"
        if num_output >= self.max_tokens:
            return "length"
        if 0 < self.max_model_len <= len(self.prompt_token_ids) + num_output:
            return "length"
        return None


class WaitingQueue:
    """Requests not running, in admission order: FCFS, or by (priority, arrival) for "priority".

    Removal is lazy: a request finished while queued is skipped when it reaches the head.
    """

    def __init__(self, policy: str) -> None:
        self._by_priority = policy == "priority"  # heap ordered by (priority, arrival)
        self._fifo: deque[Request] = deque()  # FCFS order
        self._heap: list[tuple[int, float, int, Request]] = []  # priority order
        self._seq = itertools.count()  # tie-break for equal keys
        self._live = 0  # queued requests not finished

    def __len__(self) -> int:
        return self._live

    def push(self, request: Request, front: bool = False) -> None:
        """Queue a request; `front` (a preempted one) puts it first under FCFS."""
        self._live += 1
        if self._by_priority:
            key = (request.priority, request.arrival_time, next(self._seq), request)
            heapq.heappush(self._heap, key)
        elif front:
            self._fifo.appendleft(request)
        else:
            self._fifo.append(request)

    def discard(self, request: Request) -> None:
        """Account for a queued request that was just finished (skipped later)."""
        self._live -= 1

    def peek(self) -> Request | None:
        """The next request to admit, or None."""
        if self._by_priority:
            while self._heap and self._heap[0][3].is_finished:
                heapq.heappop(self._heap)
            return self._heap[0][3] if self._heap else None
        while self._fifo and self._fifo[0].is_finished:
            self._fifo.popleft()
        return self._fifo[0] if self._fifo else None

    def pop(self) -> Request:
        """Remove and return the request `peek` returned."""
        request = heapq.heappop(self._heap)[3] if self._by_priority else self._fifo.popleft()
        self._live -= 1
        return request
