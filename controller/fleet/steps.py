"""The step loop of an executor session: schedule, send, receive, apply, deliver.

This is the per-step path, kept apart from the session's connection lifecycle (session.py):
`ExecutorSession` inherits `StepLoop`. Up to `pipeline_depth` steps are in flight: the next one
is scheduled and sent while the executor runs the previous one, so the device never waits for
the controller. Each result's updates become the clients' deltas, and the step's metrics.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import TYPE_CHECKING

from controller.fleet.tracked import count_finished, deliver, hold_quietly, make_delta

if TYPE_CHECKING:
    from common.wire.step_types import StepInput
    from controller.core.scheduler import RequestUpdate, SchedulerBase
    from controller.fleet.client import ExecutorClient
    from controller.fleet.health import HealthMonitor
    from controller.fleet.owner import SessionOwner
    from controller.fleet.placed import PlacedRequests
    from controller.fleet.placement import StepCostModel
    from controller.fleet.tracked import Tracked
    from controller.observe.metrics import EngineMetrics, ExecutorSeries
    from controller.settings import ControllerConfig


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
            if self.leaving and not self.tracked and not inflight:
                return  # drained (the session ends)
            if len(inflight) < max(depth, 1) and sched.has_unfinished_requests():
                if target > 0:  # a slow device's steps kept short (StepCostModel.step_budget)
                    sched.token_budget = self.cost.step_budget(
                        target, sched.config.max_num_batched_tokens, sched.num_running + 1
                    )
                step = sched.schedule()
                if step.num_requests:
                    sent = time.perf_counter()
                    if step.new_requests:
                        self._stamp_scheduled(step, sent)
                    await self.health.guard(self.client.send_step(step))
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
            find = self.tracked.get  # bound once per step: the lookup runs per request
            for update in updates:
                tracked = find(update.request_id)
                if tracked is not None and tracked.request is not None:
                    self._emit(tracked, update, now, series)
            self.metrics.step_done(series, num_tokens, step.num_requests, seconds, sched.stats())

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
