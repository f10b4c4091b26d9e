"""The step scheduler of one executor: token budget, chunked prefill, preemption by recompute.

There are no prefill and decode phases. Every step, each admitted request's
`num_computed_tokens` catches up with its `num_tokens` (prompt plus generated tokens) as far as
the token budget allows: running requests first, then waiting ones. A prompt longer than the
budget is computed over several steps (chunked prefill); the executor samples a token for a
request only in the step that completes its tokens.
"""

from __future__ import annotations

from common.step_types import CachedRequestData, NewRequestData, StepInput, StepOutput
from controller.kv_cache import KVCacheManager
from controller.request import FINISH_REASONS, FinishReason, Request, RequestStatus, WaitingQueue
from controller.scheduler_base import (  # noqa: F401  (re-exported: the scheduler's interface)
    POLICIES,
    RequestUpdate,
    SchedulerBase,
    SchedulerConfig,
    SchedulerStats,
    load_scheduler_class,
)


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
