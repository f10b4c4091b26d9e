"""The step loop of an executor session: schedule, send, receive, apply, deliver.

This is the per-step path, kept apart from the session's connection lifecycle (session.py):
`ExecutorSession` inherits `StepLoop`. Up to `pipeline_depth` steps are in flight: the next one
is scheduled and sent while the executor runs the previous one, so the device never waits for
the controller. Each result's updates become the clients' deltas, and the step's metrics.

A request fails alone: one whose data cannot be put on the wire is left out of its step and
finished with an error (the rest of the step goes out), and one whose delta cannot be made (the
detokenizer, stop strings) is finished with an error too. Nothing a request carries can raise
out of the loop, which would count the executor as lost.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from common.wire.convert import step_wire_problems
from controller.core.scheduler_base import RequestUpdate
from controller.fleet.client import StepNotSendable
from controller.fleet.tracked import (
    count_finished,
    deliver,
    error_delta,
    hold_quietly,
    make_delta,
)

if TYPE_CHECKING:
    from common.wire.step_types import StepInput
    from controller.core.scheduler import SchedulerBase
    from controller.fleet.client import ExecutorClient
    from controller.fleet.health import HealthMonitor
    from controller.fleet.owner import SessionOwner
    from controller.fleet.placed import PlacedRequests
    from controller.fleet.placement import StepCostModel
    from controller.fleet.tracked import Tracked
    from controller.observe.metrics import EngineMetrics, ExecutorSeries
    from controller.settings import ControllerConfig

log = logging.getLogger(__name__)


class StepLoop:
    """The step loop of one executor session (`ExecutorSession` inherits it). It works on the
    session's attributes declared here, and its metric `series`."""

    owner: SessionOwner  # told about finished requests
    config: ControllerConfig  # pipeline_depth, step_time_target
    metrics: EngineMetrics  # per-step and per-token metrics
    address: str  # host:port
    client: ExecutorClient  # sends steps, receives results
    health: HealthMonitor  # guards each call; raises once the session is lost
    scheduler: SchedulerBase | None  # the current connection's scheduler
    cost: StepCostModel  # measured step times, and the step budget they allow
    tracked: PlacedRequests  # requests placed here
    leaving: bool  # left discovery: drain, then stop
    assigned_to: str  # another controller's by the division: drain, then hand over
    steps: int  # steps run
    tokens: int  # tokens computed
    _wake: asyncio.Event  # set when work arrives or the session must end

    @property
    def series(self) -> ExecutorSeries:
        """The executor's metric series (the session binds it)."""
        raise NotImplementedError

    async def _run_steps(self) -> None:
        """Schedule, send and apply steps until the session is lost (or drained).

        Up to `pipeline_depth` steps are in flight: the next one is scheduled and sent while
        the executor runs the previous one, so the device never waits for the controller."""
        sched = self.scheduler
        assert sched is not None
        depth = self.config.pipeline_depth if sched.supports_pipelining else 1
        target = self.config.step_time_target
        inflight: deque[tuple[StepInput, float]] = deque()  # sent steps, oldest first
        last_done = 0.0  # when the previous result arrived
        while True:
            self.health.check()
            if (self.leaving or self.assigned_to) and not self.tracked and not inflight:
                return  # drained (the session ends, or hands the executor over)
            if (
                len(inflight) < max(depth, 1)
                and sched.has_unfinished_requests()
                and not (inflight and sched.needs_results_first())
            ):
                if target > 0:  # a slow device's steps kept short (StepCostModel.step_budget)
                    sched.token_budget = self.cost.step_budget(
                        target, sched.config.max_num_batched_tokens, sched.num_running + 1
                    )
                step = sched.schedule()
                if step.num_requests:
                    sent = time.perf_counter()
                    if step.new_requests:
                        self._stamp_scheduled(step, sent)
                    step = await self._send(step)
                    inflight.append((step, sent))
                    continue
            if not inflight:
                # Idle, or nothing fits now (e.g. waiting for blocks): let other tasks run.
                self._wake.clear()
                if not sched.has_unfinished_requests():
                    await self._wake.wait()
                    continue
                try:
                    await asyncio.wait_for(self._wake.wait(), timeout=0.05)
                except TimeoutError:
                    pass
                continue
            step, sent = inflight.popleft()
            output = await self.health.guard(self.client.receive_result(step))
            updates = sched.update_from_output(step, output)
            now = time.perf_counter()
            seconds = now - max(sent, last_done)  # the executor's time on this step
            last_done = now
            num_tokens = step.num_scheduled_tokens
            self.cost.observe(num_tokens, seconds)
            self.steps += 1
            self.tokens += num_tokens
            series = self.series
            self._deliver_updates(updates, now, series)
            self.metrics.step_done(series, num_tokens, step.num_requests, seconds, sched.stats())

    def _deliver_updates(
        self, updates: list[RequestUpdate], now: float, series: ExecutorSeries
    ) -> None:
        """Each update to its request (`_emit`). This runs per token, so the two common cases
        are inlined: a plain token of a non-streamed request is only counted and held
        (`hold_quietly`), and one of a tokens-only request that already started goes to its
        sink (`_emit_tokens`)."""
        find = self.tracked.get  # bound once per step: the lookup runs per request
        tokens_generated = self.metrics.tokens_generated
        for update in updates:
            tracked = find(update.request_id)
            if tracked is None or tracked.request is None:
                continue
            try:
                if update.new_token_ids and not update.finished and not tracked.lost_at:
                    if tracked.tokens_only:
                        if tracked.delivered and not update.error:
                            ids = update.new_token_ids
                            tokens_generated(series, tracked.stats, len(ids), now)
                            tracked.queue.put_tokens(  # type: ignore[attr-defined]
                                ids, None, tracked.num_cached_tokens, update.logprobs
                            )
                            continue
                    elif tracked.quiet and update.logprobs is None and not update.prompt_logprobs:
                        count = len(update.new_token_ids)
                        tokens_generated(series, tracked.stats, count, now)
                        tracked.unsent_tokens += count
                        continue
                self._emit(tracked, update, now, series)
            except Exception as exc:  # this request's fault: it fails alone
                self._emit_failed(tracked, exc, series)

    async def _send(self, step: StepInput) -> StepInput:
        """Send a step; the step sent. Requests whose data cannot be converted are left out
        and fail alone (the executor never sees them)."""
        try:
            await self.health.guard(self.client.send_step(step))
            return step
        except StepNotSendable as exc:
            problems = step_wire_problems(step)
            if not problems:  # no request alone explains it: none of them can go
                reason = f"the step could not be sent to the executor: {exc}"
                problems = {
                    r.request_id: reason for r in [*step.new_requests, *step.cached_requests]
                }
        log.warning(
            "executor %s: %d requests of step %d cannot be sent; they fail alone",
            self.address,
            len(problems),
            step.step_id,
        )
        self.fail_requests(problems)
        step = replace(
            step,
            new_requests=[r for r in step.new_requests if r.request_id not in problems],
            cached_requests=[r for r in step.cached_requests if r.request_id not in problems],
        )
        await self.health.guard(self.client.send_step(step))
        return step

    def fail_requests(self, errors: dict[str, str]) -> None:
        """Finish these requests (by id, with why) with an error to their clients, freeing
        their blocks; the session and the other requests go on."""
        sched = self.scheduler
        assert sched is not None
        sched.finish_requests(list(errors), "error")
        now, series = time.perf_counter(), self.series
        for rid, error in errors.items():
            tracked = self.tracked.get(rid)
            if tracked is None:
                continue
            log.warning("request %s failed: %s", rid, error, extra=tracked.log_extra)
            update = RequestUpdate(rid, finished=True, finish_reason="error", error=error)
            try:
                self._emit(tracked, update, now, series)
            except Exception as exc:
                self._emit_failed(tracked, exc, series)

    def _emit_failed(self, tracked: Tracked, exc: Exception, series: ExecutorSeries) -> None:
        """Making a request's delta raised: finish it with an error (a bare delta, no text)."""
        rid = tracked.gen.request_id
        log.exception("request %s: its output failed", rid, extra=tracked.log_extra)
        if self.scheduler is not None:
            self.scheduler.finish_requests([rid], "error")
        if self.tracked.remove(tracked):
            deliver(tracked, error_delta(tracked, f"the request's output failed: {exc!r}"[:300]))
            count_finished(self.metrics, "error", tracked, time.perf_counter(), series)
            self.owner.request_done(tracked, "error", self.address, time.perf_counter())

    def _stamp_scheduled(self, step: StepInput, sent: float) -> None:
        """The queue time of requests scheduled the first time ends when their step goes out."""
        for new in step.new_requests:
            tracked = self.tracked.get(new.request_id)
            if tracked is not None and not tracked.stats.scheduled_at:
                tracked.stats.scheduled_at = sent
                self.metrics.request_scheduled(self.series, sent - tracked.stats.arrival)

    def _emit(
        self, tracked: Tracked, update: RequestUpdate, now: float, series: ExecutorSeries
    ) -> None:
        """One request's update: its metrics, its client's delta, its end."""
        if update.new_token_ids:
            metrics = self.metrics
            metrics.tokens_generated(series, tracked.stats, len(update.new_token_ids), now)
            if tracked.lost_at:
                metrics.failover_resumed(series, now - tracked.lost_at)
                tracked.lost_at = 0.0
        if tracked.tokens_only and not update.error:
            self._emit_tokens(tracked, update, now, series)
            return
        if hold_quietly(tracked, update):
            return
        delta = make_delta(tracked, update)
        if delta.finished and not update.finished:  # a stop string matched
            assert self.scheduler is not None
            self.scheduler.finish_requests([update.request_id], "stop")
        deliver(tracked, delta)
        if delta.finished:
            self.tracked.remove(tracked)
            count_finished(self.metrics, delta.finish_reason, tracked, now, series)
            self.owner.request_done(tracked, delta.finish_reason, self.address, now)

    def _emit_tokens(
        self, tracked: Tracked, update: RequestUpdate, now: float, series: ExecutorSeries
    ) -> None:
        """A tokens-only request's update: its raw ids to its sink (a stream writer's)."""
        reason = update.finish_reason if update.finished else None
        if reason is not None or not tracked.delivered:
            # The sink sends the hit with the first tokens and the end only; it is fixed once
            # the request is first scheduled (Tracked.note_cache_hit).
            tracked.note_cache_hit()
        sink = tracked.queue
        sink.put_tokens(  # type: ignore[attr-defined]
            update.new_token_ids, reason, tracked.num_cached_tokens, update.logprobs
        )
        tracked.delivered = True
        if update.finished:
            self.tracked.remove(tracked)
            count_finished(self.metrics, reason, tracked, now, series)
            self.owner.request_done(tracked, reason, self.address, now)
