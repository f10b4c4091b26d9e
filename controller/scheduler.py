"""The step scheduler of one executor: token budget, chunked prefill, preemption by recompute.

There are no prefill and decode phases. Every step, each admitted request's
`num_computed_tokens` catches up with its `num_tokens` (prompt plus generated tokens) as far as
the token budget allows: running requests first, then waiting ones. A prompt longer than the
budget is computed over several steps (chunked prefill); the executor samples a token for a
request only in the step that completes its tokens.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field

from common.step_types import (
    CachedRequestData,
    NewRequestData,
    StepInput,
    StepOutput,
    TokenLogprobs,
)
from controller.kv_cache import KVCacheManager
from controller.request import FINISH_REASONS, FinishReason, Request, RequestStatus, WaitingQueue

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Limits and switches of one executor's scheduler."""

    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # most running requests (and so most requests in a step)
    long_prefill_token_threshold: int = 0  # most tokens of one request per step; 0 = no cap
    policy: str = "fcfs"  # "fcfs" or "priority" (lower Request.priority first)
    enable_prefix_caching: bool = True  # reuse cached full blocks across requests
    chunked_prefill: bool = True  # executor capability: a prompt may span several steps
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks of the executor, null block included; must be set (>= 2)
    max_model_len: int = 0  # default Request.max_model_len; 0 = no limit

    def validate(self) -> None:
        """Raise ValueError on an unusable configuration."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; use one of {POLICIES}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.long_prefill_token_threshold < 0 or self.max_model_len < 0:
            raise ValueError("long_prefill_token_threshold and max_model_len must be >= 0")
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError("block_size must be positive and num_blocks at least 2")


@dataclass
class RequestUpdate:
    """What one step changed for one request, for the detokenizer and the client stream."""

    request_id: str  # the request
    new_token_ids: list[int] = field(default_factory=list)  # tokens appended (a stop id included)
    finished: bool = False  # the request has ended
    finish_reason: FinishReason | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions done
    error: str = ""  # why the request failed, for finish_reason "error"


@dataclass
class SchedulerStats:
    """A snapshot for metrics and placement."""

    num_running: int  # admitted requests
    num_waiting: int  # queued requests, preempted ones included
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_used_blocks: int  # KV blocks held by requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # tokens found there (cumulative)
    num_preemptions: int  # requests preempted (cumulative)
    num_scheduled_tokens: int  # tokens scheduled by the last step


class SchedulerBase(abc.ABC):
    """The interface the engine drives; subclass it to plug in a policy (`--scheduler mod:Class`).

    Contract, per executor and one step at a time:

    - `__init__(config)` gets a `SchedulerConfig`; the KV block pool is the scheduler's to own.
    - `add_request(request)` queues a new `Request` (status WAITING).
    - `schedule()` returns the next `StepInput`: a diff against what the executor holds. A
      request it has not seen (or must recompute) is a `NewRequestData` with its whole block
      table; a known one is a `CachedRequestData` with only its new blocks. Per step the total
      of `num_scheduled_tokens` stays within `max_num_batched_tokens` and at most
      `max_num_seqs` requests run. Every id finished, aborted or preempted since the previous
      step goes in `finished_request_ids` (the executor handles those first). `step_id`
      increases by one from 1. A step that schedules no request is not meant to be sent: it
      takes no step id and no finished ids (those ride the next step with work).
    - `update_from_output(step, output)` applies the executor's answer to `step`: advance
      `num_computed_tokens`, append sampled tokens, decide stops, free finished requests'
      blocks, and return one `RequestUpdate` per request with something new. Outputs for
      requests finished in the meantime are ignored.
    - `finish_requests(ids, reason)` ends requests from outside ("abort" from a client that
      left, "stop" for a stop string): free their blocks; unknown or finished ids are ignored.
    - When every request has finished, no KV block may be held.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never be scheduled."""

    @abc.abstractmethod
    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """End requests now (client abort, stop string), freeing their blocks."""

    @abc.abstractmethod
    def schedule(self) -> StepInput:
        """Build the next step."""

    @abc.abstractmethod
    def update_from_output(self, step: StepInput, output: StepOutput) -> list[RequestUpdate]:
        """Apply a step's result; return what changed per request."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Admitted requests."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Queued requests."""

    @abc.abstractmethod
    def stats(self) -> SchedulerStats:
        """Current numbers for metrics."""

    @abc.abstractmethod
    def get_request(self, request_id: str) -> Request | None:
        """A live (unfinished) request, or None."""

    def peek_prefix_hit(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of a sequence (its full-block hashes, its length) this executor's prefix
        cache would serve now, without side effects; placement uses it. 0 unless overridden."""
        return 0


class Scheduler(SchedulerBase):
    """The default scheduler: FCFS, or strict priority with `policy="priority"`.

    Running requests are scheduled first, in admission order; when the pool runs out of blocks
    the least important running request (FCFS: the last admitted; priority: the largest
    priority value, then the latest arrival) is preempted by recompute. Waiting requests are
    admitted only in steps without a preemption, while budget, `max_num_seqs` and blocks last.
    """

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}  # live requests by id
        self.waiting = WaitingQueue(config.policy)  # not admitted, or preempted
        self.running: list[Request] = []  # admitted, in admission order
        self._finished_ids: list[str] = []  # to tell the executor in the next step
        self._step_id = 0  # last step id handed out
        self._num_preemptions = 0  # cumulative
        self._last_step_tokens = 0  # tokens scheduled by the last step

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    def peek_prefix_hit(self, block_hashes: list[bytes], num_tokens: int) -> int:
        return self.kv.peek_prefix_hit(block_hashes, num_tokens)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_usage=self.kv.usage,
            num_used_blocks=self.kv.num_used_blocks,
            prefix_cache_queries=self.kv.prefix_cache_queries,
            prefix_cache_hits=self.kv.prefix_cache_hits,
            num_preemptions=self._num_preemptions,
            num_scheduled_tokens=self._last_step_tokens,
        )

    # -- requests in and out -----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never be scheduled.

        `request.max_model_len` (0: none) becomes the least of itself, the config's and what
        this executor can run alone: the whole block pool and, without chunked prefill, one
        step's token budget (a preempted request is recomputed in one step). Reaching it ends
        the request with "length", so no request can outgrow the executor.
        """
        cfg = self.config
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} already exists")
        if not request.prompt_token_ids:
            raise ValueError("the prompt is empty")
        if request.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {request.max_tokens}")
        limits = [(cfg.block_size * (cfg.num_blocks - 1), "the KV cache holds")]
        if not cfg.chunked_prefill:
            limits.append((cfg.max_num_batched_tokens, "this executor computes in one step"))
        limits += [(n, "max_model_len is") for n in (request.max_model_len, cfg.max_model_len) if n]
        for limit, what in limits:
            if request.num_prompt_tokens > limit:
                raise ValueError(
                    f"the prompt has {request.num_prompt_tokens} tokens; {what} {limit}"
                )
        request.max_model_len = min(limit for limit, _ in limits)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.push(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        if reason not in FINISH_REASONS:
            raise ValueError(f"unknown finish reason {reason!r}")
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason, unlink: bool = True) -> None:
        """End a live request: free its blocks, leave its queue (`unlink`), tell the executor."""
        if request.status is RequestStatus.RUNNING:
            if unlink:
                self.running.remove(request)
            self._finished_ids.append(request.request_id)
        else:
            self.waiting.discard(request)
        self.kv.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self.requests[request.request_id]

    # -- scheduling --------------------------------------------------------------------------

    def _cap(self, num_tokens: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if threshold > 0:
            num_tokens = min(num_tokens, threshold)
        return min(num_tokens, budget)

    def _pick_victim(self) -> Request:
        if self.config.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, victim: Request) -> None:
        """Evict a running request by recompute: no blocks, back to the head of the queue."""
        self.running.remove(victim)
        self.kv.free(victim)  # before resetting num_computed_tokens (see KVCacheManager.free)
        victim.num_computed_tokens = 0
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self._finished_ids.append(victim.request_id)
        self.waiting.push(victim, front=True)

    def schedule(self) -> StepInput:
        """Running requests first (preempting when blocks run out), then waiting ones."""
        budget = self.config.max_num_batched_tokens
        cached: dict[str, CachedRequestData] = {}
        preempted = False

        index = 0
        while index < len(self.running):
            request = self.running[index]
            num_new = self._cap(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            while True:
                new_block_ids = self.kv.allocate_slots(request, num_new)
                if new_block_ids is not None:
                    break
                victim = self._pick_victim()
                victim_index = self.running.index(victim)
                self._preempt(victim)
                preempted = True
                entry = cached.pop(victim.request_id, None)
                if entry is not None:  # scheduled earlier in this step: take it back
                    budget += entry.num_scheduled_tokens
                if victim_index < index:
                    index -= 1
                if victim is request:
                    break
            if new_block_ids is None:
                continue  # `request` preempted itself; the next one is now at `index`
            cached[request.request_id] = CachedRequestData(
                request.request_id, new_block_ids, request.num_computed_tokens, num_new
            )
            budget -= num_new
            index += 1

        new: list[NewRequestData] = []
        while not preempted and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            if request is None:
                break
            computed_blocks, num_hit = self.kv.get_computed_blocks(request)
            num_remaining = request.num_tokens - num_hit
            if not self.config.chunked_prefill:
                if num_remaining > budget:
                    break  # it fits a whole step (see add_request): wait for one
                num_new = num_remaining
            else:
                num_new = self._cap(num_remaining, budget)
            block_ids = self.kv.allocate_slots(request, num_new, computed_blocks)
            if block_ids is None:
                break  # it fits the empty pool (see add_request): wait for blocks
            self.waiting.pop()
            if request.status is RequestStatus.WAITING:
                request.num_cached_tokens = num_hit
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            self.running.append(request)
            new.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling=request.sampling,
                    block_ids=block_ids,
                    num_computed_tokens=num_hit,
                    num_scheduled_tokens=num_new,
                )
            )
            budget -= num_new

        self._last_step_tokens = self.config.max_num_batched_tokens - budget
        if not new and not cached:  # nothing to send: keep the step id and the finished ids
            return StepInput(step_id=self._step_id + 1)
        self._step_id += 1
        step = StepInput(self._step_id, new, list(cached.values()), self._finished_ids)
        self._finished_ids = []
        return step

    # -- results -----------------------------------------------------------------------------

    def update_from_output(self, step: StepInput, output: StepOutput) -> list[RequestUpdate]:
        """Advance computed tokens, append sampled ones, finish on stop / length / error."""
        updates: list[RequestUpdate] = []
        scheduled = {r.request_id: r.num_scheduled_tokens for r in step.new_requests}
        scheduled.update((r.request_id, r.num_scheduled_tokens) for r in step.cached_requests)
        num_finished = 0
        for out in output.outputs:
            request = self.requests.get(out.request_id)
            num_scheduled = scheduled.get(out.request_id)
            if (
                request is None
                or num_scheduled is None
                or request.status is not RequestStatus.RUNNING
            ):
                continue  # finished, aborted or preempted meanwhile, or not part of this step
            update = RequestUpdate(out.request_id, prompt_logprobs=out.prompt_logprobs)
            if out.error:
                update.finish_reason, update.error = "error", out.error
            else:
                request.num_computed_tokens += num_scheduled
                # Only the step that completes the request's known tokens samples one.
                token = out.sampled_token_id
                if token is not None and request.num_computed_tokens == request.num_tokens:
                    request.output_token_ids.append(token)
                    update.new_token_ids = [token]
                    update.logprobs = None if out.logprobs is None else [out.logprobs]
                    update.finish_reason = request.check_stop()
            if update.finish_reason is not None:
                self._finish(request, update.finish_reason, unlink=False)
                update.finished = True
                num_finished += 1
            if update.new_token_ids or update.prompt_logprobs or update.finished:
                updates.append(update)
        if num_finished:  # one pass instead of a list removal per finished request
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return updates


def load_scheduler_class(spec: str) -> type[SchedulerBase]:
    """Import a scheduler class named "package.module:ClassName".

    ValueError for a malformed name or a module that does not import; TypeError when the
    object is not a subclass of SchedulerBase.
    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"scheduler {spec!r} is not of the form 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import scheduler module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, SchedulerBase):
        raise TypeError(f"{spec!r} is not a subclass of controller.scheduler.SchedulerBase")
    return cls
