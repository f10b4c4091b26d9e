"""The step scheduler of one executor: token budget, chunked prefill, preemption by recompute.

There are no prefill and decode phases. Every step, each admitted request's
`num_computed_tokens` catches up with its `num_tokens` (prompt plus generated tokens) as far as
the token budget allows: running requests first, then waiting ones. A prompt longer than the
budget is computed over several steps (chunked prefill); the executor samples a token for a
request only in the step that completes its tokens.

Steps may be pipelined: `schedule()` advances `num_computed_tokens` at once, and a step that
samples a token leaves a placeholder (`num_pending_tokens`), so the next step can be scheduled
and sent while this one runs; it computes the placeholder, which the executor fills with the
token it sampled. `update_from_output()` replaces placeholders by the tokens in order. A result
for a request finished or preempted since its step was scheduled is dropped (at most one token
of work per step in flight is wasted that way).
"""

from __future__ import annotations

from common.wire.step_types import (
    CachedRequestData,
    NewRequestData,
    StepInput,
    StepOutput,
)
from controller.core.kv_cache import KVCacheManager
from controller.core.output_grammar import next_mask
from controller.core.request import (
    FINISH_REASONS,
    FinishReason,
    Request,
    RequestStatus,
    WaitingQueue,
)
from controller.core.scheduler_base import (  # noqa: F401  (re-exported: the scheduler's interface)
    POLICIES,
    RequestUpdate,
    SchedulerBase,
    SchedulerConfig,
    SchedulerStats,
    load_scheduler_class,
)
from controller.core.step_results import Scheduled as _Scheduled
from controller.core.step_results import apply_outputs, apply_tokens


class Scheduler(SchedulerBase):
    """The default scheduler: FCFS, or strict priority with `policy="priority"`.

    Running requests are scheduled first, in admission order; when the pool runs out of blocks
    the least important running request (FCFS: the last admitted; priority: the largest
    priority value, then the latest arrival) is preempted by recompute. Waiting requests are
    admitted only in steps without a preemption, while budget, `max_num_seqs` and blocks last.
    """

    supports_pipelining = True

    def __init__(self, config: SchedulerConfig) -> None:
        super().__init__(config)
        self.kv = KVCacheManager(
            config.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            config.sliding_window,
        )
        self.requests: dict[str, Request] = {}  # live requests by id
        self.waiting = WaitingQueue(config.policy)  # not admitted, or preempted
        self.running: list[Request] = []  # admitted, in admission order
        self._finished_ids: list[str] = []  # to tell the executor in the next step
        self._step_id = 0  # last step id handed out
        self._num_preemptions = 0  # cumulative
        self._last_step_tokens = 0  # tokens scheduled by the last step
        self._inflight: dict[int, dict[str, _Scheduled]] = {}  # step id -> what it does
        self._num_constrained = 0  # live requests with an output grammar

    # -- queries -----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def needs_results_first(self) -> bool:
        return self._num_constrained > 0

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
        request.stop_set = frozenset(request.stop_token_ids).union(
            () if request.ignore_eos else request.eos_token_ids
        )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        if request.grammar is not None:
            self._num_constrained += 1
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
        if request.grammar is not None:
            self._num_constrained -= 1

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
        victim.num_pending_tokens = 0  # its steps in flight are void (see _Scheduled.epoch)
        victim.status = RequestStatus.PREEMPTED
        victim.num_preemptions += 1
        self._num_preemptions += 1
        self._finished_ids.append(victim.request_id)
        self.waiting.push(victim, front=True)

    def schedule(self) -> StepInput:
        """Running requests first (preempting when blocks run out), then waiting ones."""
        full_budget = self.config.max_num_batched_tokens
        if self.config.chunked_prefill:  # an unchunked prompt needs the whole budget
            full_budget = max(1, min(self.token_budget, full_budget))
        cached: dict[str, CachedRequestData] = {}
        plan: dict[str, _Scheduled] = {}
        budget, preempted = self._schedule_running(full_budget, cached, plan)
        new: list[NewRequestData] = []
        if not preempted:
            budget = self._schedule_waiting(budget, new, plan)

        self._last_step_tokens = full_budget - budget
        if not new and not cached:  # nothing to send: keep the step id and the finished ids
            return StepInput(step_id=self._step_id + 1)
        self._step_id += 1
        step = StepInput(self._step_id, new, list(cached.values()), self._finished_ids)
        self._finished_ids = []
        self._inflight[self._step_id] = plan
        return step

    def _schedule_running(
        self, budget: int, cached: dict[str, CachedRequestData], plan: dict[str, _Scheduled]
    ) -> tuple[int, bool]:
        """Schedule the running requests in order, within `budget`; (budget left, whether a
        request was preempted). Runs once per running request per step, so it is inlined:
        num_tokens, can_sample_more, _cap, _advance, and the decode fast path (a request whose
        table has room and no block newly full needs no `allocate_slots` call)."""
        threshold = self.config.long_prefill_token_threshold
        running = self.running
        preempted = False
        index = 0
        while index < len(running):
            request = running[index]
            num_output = len(request.output_token_ids)
            pending = request.num_pending_tokens
            num_known = len(request.prompt_token_ids) + num_output
            start = request.num_computed_tokens
            num_new = num_known + pending - start
            if pending and request.grammar is not None:
                index += 1  # its next allowed tokens depend on the token in flight
                continue
            if pending and (
                num_output + pending >= request.max_tokens
                or (0 < request.max_model_len <= num_known + pending)
            ):
                num_new = 0  # what is left is placeholders, computed only to sample more
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            if num_new <= 0:
                index += 1
                continue
            num_total = start + num_new
            if num_total <= request.kv_room and min(num_total, num_known) < request.kv_hash_limit:
                new_block_ids: list[int] | None = []  # room held, no block to cache
            else:
                new_block_ids = self.kv.allocate_slots(request, num_new)
                if new_block_ids is None:
                    preempted = True
                    new_block_ids, index, freed = self._preempt_for(
                        request, num_new, index, cached, plan
                    )
                    budget += freed
                    if new_block_ids is None:
                        continue  # `request` preempted itself; the next one is now at `index`
            rid = request.request_id
            request.num_computed_tokens = num_total
            # A chunk reaching the end of the known tokens and placeholders samples one more.
            samples = num_total == num_known + pending
            mask = None
            if samples:
                request.num_pending_tokens = pending + 1
                if request.grammar is not None:
                    mask = next_mask(request)
            cached[rid] = CachedRequestData(rid, new_block_ids, start, num_new, mask)
            plan[rid] = (request, start, samples, request.num_preemptions)  # type: ignore[assignment]
            budget -= num_new
            index += 1
        return budget, preempted

    def _preempt_for(
        self,
        request: Request,
        num_new: int,
        index: int,
        cached: dict[str, CachedRequestData],
        plan: dict[str, _Scheduled],
    ) -> tuple[list[int] | None, int, int]:
        """Preempt victims until `request` (at `index` of running) gets its slots, or is the
        victim itself. Returns (its new block ids, or None when it was preempted; its index in
        running now; the tokens given back by victims scheduled earlier in this step)."""
        freed = 0
        while True:
            victim = self._pick_victim()
            victim_index = self.running.index(victim)
            self._preempt(victim)
            entry = cached.pop(victim.request_id, None)
            if entry is not None:  # scheduled earlier in this step: take it back
                freed += entry.num_scheduled_tokens
                del plan[victim.request_id]
            if victim_index < index:
                index -= 1
            if victim is request:
                return None, index, freed
            new_block_ids = self.kv.allocate_slots(request, num_new)
            if new_block_ids is not None:
                return new_block_ids, index, freed

    def _schedule_waiting(
        self, budget: int, new: list[NewRequestData], plan: dict[str, _Scheduled]
    ) -> int:
        """Admit waiting requests while budget, `max_num_seqs` and blocks last; the budget
        left."""
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
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
            entry = plan[request.request_id] = self._advance(request, num_new)
            new.append(
                NewRequestData(
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=list(request.output_token_ids),
                    sampling=request.sampling,
                    block_ids=block_ids,
                    num_computed_tokens=num_hit,
                    num_scheduled_tokens=num_new,
                    allowed_token_mask=(
                        next_mask(request)
                        if entry.samples and request.grammar is not None
                        else None
                    ),
                )
            )
            budget -= num_new
        return budget

    @staticmethod
    def _advance(request: Request, num_new: int) -> _Scheduled:
        """Count a scheduled chunk as computed; a chunk that reaches the end of the request's
        tokens (placeholders included) samples one more: a new placeholder."""
        start = request.num_computed_tokens
        request.num_computed_tokens += num_new
        samples = request.num_computed_tokens == request.num_tokens + request.num_pending_tokens
        if samples:
            request.num_pending_tokens += 1
        return _Scheduled(request, start, samples, request.num_preemptions)

    # -- results -----------------------------------------------------------------------------

    def update_from_output(self, step: StepInput, output: StepOutput) -> list[RequestUpdate]:
        """Replace placeholders by sampled tokens, finish on stop / length / error.

        Steps must be applied in the order they were scheduled."""
        plan = self._inflight.pop(step.step_id, {})
        if output.sampled_token_ids is not None and not output.outputs:
            updates, num_finished = apply_tokens(step, output.sampled_token_ids, plan, self._end)
        else:
            updates, num_finished = apply_outputs(step, output, plan, self._end)
        if num_finished:  # one pass instead of a list removal per finished request
            self.running = [r for r in self.running if r.status is RequestStatus.RUNNING]
        return updates

    def _end(self, request: Request, reason: FinishReason) -> None:
        """Finish a request whose result ended it (still in `running`: removed in one pass)."""
        self._finish(request, reason, unlink=False)
