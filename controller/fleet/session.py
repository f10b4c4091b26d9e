"""One executor session: connection, handshake, health checks, scheduler and step loop.

An `ExecutorRunner` lives from the moment the controller learns an executor's address until
the address leaves discovery. It connects (health check, then the handshake), builds a fresh
scheduler and block pool for the executor's KV cache, and drives steps while health checks run
beside it. A broken stream, a step past its deadline or failed health checks make the executor
lost: its requests are handed back to the engine (which moves them elsewhere) and the runner
reconnects with backoff. Every successful handshake reinitializes the executor's KV cache, so
the runner always starts with an empty pool; a new incarnation id also tells it the process
restarted.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections import Counter, deque
from typing import TYPE_CHECKING

from common.wire.config import DeviceInfo
from controller.core.request import RequestStatus
from controller.core.scheduler import (
    RequestUpdate,
    Scheduler,
    SchedulerBase,
    SchedulerConfig,
    load_scheduler_class,
)
from controller.fleet.client import ExecutorClient, ExecutorLost
from controller.fleet.health import HealthMonitor
from controller.fleet.placement import StepCostModel
from controller.fleet.tracked import Tracked, deliver, hold_quietly, make_delta

if TYPE_CHECKING:
    from common.wire.step_types import StepInput
    from controller.fleet.engine import Engine

log = logging.getLogger(__name__)


class RunnerState(enum.Enum):
    """Where an executor session stands."""

    CONNECTING = "connecting"  # first handshake not done yet
    HEALTHY = "healthy"  # connected; takes new work
    UNHEALTHY = "unhealthy"  # lost; reconnecting with backoff
    DRAINING = "draining"  # left discovery: finishes its requests, takes no new work
    REMOVED = "removed"  # gone for good


class ExecutorRunner:
    """One executor: client, health checks, scheduler and the step loop that drives it."""

    def __init__(self, engine: Engine, address: str, source: str = "static"):
        cfg = engine.config
        self.engine = engine  # the owning engine
        self.address = address  # host:port
        self.source = source  # how it was found: static, dns or file
        self.client = ExecutorClient(address, cfg.step_timeout, engine.executor_security)
        self.scheduler: SchedulerBase | None = None  # rebuilt by every handshake
        self.info: DeviceInfo | None = None  # the latest InitDevice answer
        self.num_blocks = 0  # KV blocks on the device
        self.max_num_batched_tokens = 0  # this executor's step budget
        self.state = RunnerState.CONNECTING  # see RunnerState
        self.state_since = time.monotonic()  # when state last changed
        self.leaving = False  # left discovery: drain, then stop
        self.tracked: dict[str, Tracked] = {}  # requests placed here
        self.cost = StepCostModel()  # measured step times
        self.last_loss = ""  # why it was last lost
        self.connect_error = ""  # why the current connection attempts fail ("" once connected)
        self.incarnations = 0  # distinct incarnation ids seen
        self.losses = 0  # times lost
        self.reconnects = 0  # handshakes after a loss
        self.requests_placed = 0  # requests placed here (moves included)
        self.steps = 0  # steps run
        self.tokens = 0  # tokens computed
        self._queued: Counter[bytes] = Counter()  # block hashes of requests placed here
        self._base_prefix = (0, 0)  # prefix-cache (queries, hits) of earlier sessions
        self._wake = asyncio.Event()  # set when work arrives or the session must end
        self.health = HealthMonitor(
            self.client,
            cfg.health_check_interval,
            cfg.health_check_timeout,
            cfg.health_check_failures,
            on_lost=self._wake.set,
        )  # judges the session lost
        self._task: asyncio.Task | None = None  # the lifecycle

    # --- queries -----------------------------------------------------------------------

    @property
    def healthy(self) -> bool:
        """Connected and taking new work."""
        return self.state is RunnerState.HEALTHY

    @property
    def block_size(self) -> int:
        """Tokens per KV block (0 before the first handshake)."""
        return self.info.kv_cache.block_size if self.info else 0

    @property
    def capacity_tokens(self) -> int:
        """Longest sequence this executor can hold (KV pool and model length)."""
        if self.info is None:
            return 0
        return min((self.num_blocks - 1) * self.block_size, self.info.model.max_model_len)

    def fits(self, num_tokens: int, max_length: int = 0) -> bool:
        """Whether a sequence of `num_tokens` known tokens, which may grow to `max_length`,
        could run here to its end (a smaller executor would cut it short)."""
        if self.info is None or max(num_tokens + 1, max_length) > self.capacity_tokens:
            return False
        return self.info.capabilities.chunked_prefill or num_tokens <= self.max_num_batched_tokens

    def prefix_hit(self, hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of a sequence with these block hashes cached here or queued here (exact)."""
        if self.scheduler is None or not self.engine.config.enable_prefix_caching:
            return 0
        cached = self.scheduler.peek_prefix_hit(hashes, num_tokens)
        usable = max(num_tokens - 1, 0) // self.block_size
        queued = 0
        for block_hash in hashes[:usable]:
            if block_hash not in self._queued:
                break
            queued += 1
        return max(cached, queued * self.block_size)

    def prefix_counters(self) -> tuple[int, int]:
        """Prefix-cache (queries, hits) in tokens, over every session with this executor."""
        s = self.scheduler.stats() if self.scheduler else None
        return (
            self._base_prefix[0] + (s.prefix_cache_queries if s else 0),
            self._base_prefix[1] + (s.prefix_cache_hits if s else 0),
        )

    def can_start_now(self, num_tokens: int) -> bool:
        """Whether a request would be admitted by the next step (room, blocks, empty queue)."""
        sched = self.scheduler
        if not self.healthy or sched is None or not self.fits(num_tokens):
            return False
        stats = sched.stats()
        free = self.num_blocks - 1 - stats.num_used_blocks
        return (
            stats.num_waiting == 0
            and stats.num_running < sched.config.max_num_seqs
            and free * self.block_size > num_tokens
        )

    def stale_waiting(self, placed_before: float) -> list[Tracked]:
        """Requests never admitted here that were placed before `placed_before` (monotonic)."""
        return [
            t
            for t in self.tracked.values()
            if t.request is not None
            and t.request.status is RequestStatus.WAITING
            and t.placed_at < placed_before
        ]

    # --- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background, then serve steps until the address leaves."""
        self._task = asyncio.create_task(self._lifecycle(), name=f"executor-{self.address}")

    async def stop(self) -> None:
        """Stop for good (controller shutdown)."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.close()

    def leave(self) -> None:
        """The address left discovery: take no new work, finish what runs, then stop."""
        if self.leaving:
            return
        self.leaving = True
        log.info(
            "executor %s left discovery (%s): draining %d requests",
            self.address,
            self.state.value,
            len(self.tracked),
        )
        if self.state is RunnerState.HEALTHY:
            self._set_state(RunnerState.DRAINING)
        self._wake.set()
        if self.state is not RunnerState.DRAINING and self._task is not None:
            self._task.cancel()  # not connected: nothing to drain (it holds no request)

    def rejoin(self) -> bool:
        """The address is back in discovery while draining: take work again."""
        if not self.leaving or self.state is not RunnerState.DRAINING:
            return False
        self.leaving = False
        self._set_state(RunnerState.HEALTHY)
        return True

    def _set_state(self, state: RunnerState) -> None:
        if state is not self.state:
            self.state, self.state_since = state, time.monotonic()

    async def _lifecycle(self) -> None:
        cfg = self.engine.config
        delay = cfg.reconnect_backoff_min
        try:
            while not self.leaving:
                await self.client.close()  # every attempt starts on a fresh channel
                try:
                    await self._connect()
                except Exception as exc:  # not up yet, or failing: retry
                    self.engine.metrics.call_failed(self, exc)
                    error = repr(exc)[:300]
                    level = logging.INFO if error != self.connect_error else logging.DEBUG
                    log.log(level, "executor %s: not connected (%s); retrying", self.address, error)
                    self.connect_error = error
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, cfg.reconnect_backoff_max)
                    continue
                delay = cfg.reconnect_backoff_min
                self.health.start()
                try:
                    await self._run_steps()  # returns once drained
                except ExecutorLost as exc:
                    self.engine.metrics.call_failed(self, exc)
                    self._on_lost(str(exc))
                except Exception as exc:  # a bug must not strand the requests placed here
                    log.exception("executor %s: step loop failed", self.address)
                    self._on_lost(f"step loop failed: {exc!r}")
                finally:
                    await self.health.stop()
        finally:
            self._set_state(RunnerState.REMOVED)
            self.engine.runner_removed(self)
            await self.client.close()

    async def _connect(self) -> None:
        """Health check, handshake, fresh scheduler; then take work."""
        cfg = self.engine.config
        status = await self.client.check_health(cfg.health_check_timeout)
        if status != "SERVING":
            if status == "UNREACHABLE":  # the health call itself failed
                self.engine.metrics.grpc_error(self, status)
            raise ExecutorLost(f"health: {status}")
        hs = await self.client.handshake(
            cfg.max_num_batched_tokens,
            cfg.max_num_seqs,
            cfg.max_model_len,
            cfg.seed,
            cfg.num_kv_blocks,
            cfg.kind_limits,
            timeout=cfg.executor_startup_timeout,
        )
        self.engine.check_compatible(self, hs.info)
        sched_cfg = SchedulerConfig.for_executor(cfg, hs.info, hs.num_blocks)
        cls = load_scheduler_class(cfg.scheduler_class) if cfg.scheduler_class else Scheduler
        self._retire_scheduler()
        self.scheduler = cls(sched_cfg)
        self.max_num_batched_tokens = sched_cfg.max_num_batched_tokens
        restarted = self.info is None or self.info.incarnation_id != hs.info.incarnation_id
        if restarted:
            self.incarnations += 1
        if self.state is not RunnerState.CONNECTING:
            self.reconnects += 1
            self.engine.metrics.executor_reconnected(self)
        if self.info is not None and (self.info.device_kind, self.info.device_name) != (
            hs.info.device_kind,
            hs.info.device_name,
        ):
            self.cost = StepCostModel()  # another device now answers at this address
        if self.cost.steps == 0:
            self.cost.set_prior(*self.engine.fleet_cost_prior(self))
        self.info, self.num_blocks = hs.info, hs.num_blocks
        self.connect_error = ""
        self._queued.clear()
        self.engine.metrics.scheduler_reset(self.address)
        log.info(
            "executor %s: %s (%s), incarnation %s%s, %d KV blocks of %d tokens, %d tokens/step, "
            "warm-up %.1fs",
            self.address,
            hs.info.device_kind,
            hs.info.device_name,
            hs.info.incarnation_id[:8],
            " (new)" if restarted else " (same process)",
            hs.num_blocks,
            hs.info.kv_cache.block_size,
            sched_cfg.max_num_batched_tokens,
            hs.warmup_seconds,
        )
        self._set_state(RunnerState.DRAINING if self.leaving else RunnerState.HEALTHY)
        self.engine.runner_ready(self)

    def _on_lost(self, reason: str) -> None:
        """Hand every request back to the engine (it moves them) and drop the session.

        Synchronous on purpose: no request can be left between two owners. The channel is
        closed by the next connection attempt.
        """
        self.losses += 1
        self.last_loss = reason[:300]
        log.warning(
            "executor %s lost: %s; moving %d requests", self.address, reason, len(self.tracked)
        )
        self.engine.metrics.executor_lost(self)
        self._set_state(RunnerState.UNHEALTHY)
        moved = list(self.tracked.values())
        for tracked in moved:
            self._detach(tracked)
        self._retire_scheduler()
        self.engine.relocate(moved, source=self, failover=True)

    def _retire_scheduler(self) -> None:
        """Drop the session's scheduler (its blocks mean nothing now), keeping its counters."""
        if self.scheduler is not None:
            s = self.scheduler.stats()
            self._base_prefix = (
                self._base_prefix[0] + s.prefix_cache_queries,
                self._base_prefix[1] + s.prefix_cache_hits,
            )
            self.scheduler = None

    # --- requests ----------------------------------------------------------------------

    def add(self, tracked: Tracked) -> None:
        """Queue a placed request here; ValueError if the scheduler can never run it."""
        assert self.scheduler is not None and tracked.request is not None
        self.scheduler.add_request(tracked.request)
        rid = tracked.gen.request_id
        self.tracked[rid] = tracked
        tracked.runner = self
        tracked.placed_at = time.monotonic()
        self._queued.update(tracked.queued_hashes)
        self.requests_placed += 1
        self._wake.set()

    def _detach(self, tracked: Tracked) -> None:
        if self.tracked.pop(tracked.gen.request_id, None) is not None:
            self._queued.subtract(tracked.queued_hashes)
            for block_hash in tracked.queued_hashes:
                if self._queued[block_hash] <= 0:
                    del self._queued[block_hash]
            tracked.runner = None

    def withdraw(self, tracked: Tracked) -> None:
        """Take back a request that was never admitted here (to place it elsewhere)."""
        if self.scheduler is not None:
            self.scheduler.finish_requests([tracked.gen.request_id], "abort")
        self._detach(tracked)

    def abort(self, tracked: Tracked) -> None:
        """The client went away: finish the request and free its blocks."""
        if tracked.gen.request_id not in self.tracked:
            return
        if self.scheduler is not None:
            self.scheduler.finish_requests([tracked.gen.request_id], "abort")
        self._detach(tracked)
        log.info("request %s aborted (client gone)", tracked.gen.request_id)
        self.engine.metrics.request_finished("abort", tracked, runner=self)
        self._wake.set()

    # --- the step loop -----------------------------------------------------------------

    async def _run_steps(self) -> None:
        """Schedule, send and apply steps until the session is lost (or drained).

        Up to `pipeline_depth` steps are in flight: the next one is scheduled and sent while
        the executor runs the previous one, so the device never waits for the controller."""
        sched = self.scheduler
        assert sched is not None
        depth = self.engine.config.pipeline_depth if sched.supports_pipelining else 1
        target = self.engine.config.step_time_target
        inflight: deque[tuple[StepInput, float]] = deque()  # sent steps, oldest first
        last_done = 0.0  # when the previous result arrived
        while True:
            self.health.check()
            if self.leaving and not self.tracked and not inflight:
                self._set_state(RunnerState.REMOVED)  # drained: too late to rejoin
                return
            if len(inflight) < max(depth, 1) and sched.has_unfinished_requests():
                if target > 0:  # a slow device's steps kept short (StepCostModel.step_budget)
                    sched.token_budget = self.cost.step_budget(
                        target, sched.config.max_num_batched_tokens, sched.num_running + 1
                    )
                step = sched.schedule()
                if step.num_requests:
                    sent = time.perf_counter()
                    self.engine.metrics.step_sent(self, step, sent)
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
            for update in updates:
                self._emit(update, now)
            self.engine.metrics.step_done(
                self, num_tokens, step.num_requests, seconds, sched.stats()
            )

    def _emit(self, update: RequestUpdate, now: float) -> None:
        tracked = self.tracked.get(update.request_id)
        if tracked is None or tracked.request is None:
            return
        metrics = self.engine.metrics
        if update.new_token_ids:
            metrics.tokens_generated(self, tracked, len(update.new_token_ids), now)
            if tracked.lost_at:
                metrics.failover_resumed(self, now - tracked.lost_at)
                tracked.lost_at = 0.0
        if hold_quietly(tracked, update):
            return
        delta = make_delta(tracked, update)
        if delta.finished and not update.finished:  # a stop string matched
            assert self.scheduler is not None
            self.scheduler.finish_requests([update.request_id], "stop")
        deliver(tracked, delta)
        if delta.finished:
            self._detach(tracked)
            self.engine.request_done(tracked, delta.finish_reason, self, now)
