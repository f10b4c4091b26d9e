"""One executor session: connection, handshake, health checks, scheduler and step loop.

An `ExecutorSession` lives from the moment the controller learns an executor's address until
the address leaves discovery. It connects (health check, then the handshake), builds a fresh
scheduler and block pool for the executor's KV cache, and drives steps while health checks run
beside it. A broken stream, a step past its deadline or failed health checks make the executor
lost: its requests are handed back to the owner (which moves them elsewhere) and the session
reconnects with backoff. Every successful handshake reinitializes the executor's KV cache, so
the session always starts with an empty pool; a new incarnation id also tells it the process
restarted. Before its handshake, a session asks the executor who it is (Identify): an executor
another session already drives (the same process under another address) is not driven twice;
this session waits as a duplicate and retries. An executor another controller owns (its lease
lives: controller.fleet.ownership) refuses the handshake: the session waits as OWNED_ELSEWHERE
and retries when that lease would expire, without counting a failure. When the session ends
for good it releases the executor, so another controller may take it at once. With peers, a
session whose executor the division gives another controller hands it over (handover.py). It
reports only through the `SessionOwner` it is given, and shows itself to the rest of the
controller as `ExecutorSnapshot`s.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from controller.fleet.channel_security import ChannelSecurity
from controller.fleet.client import (
    ExecutorClient,
    ExecutorLost,
    OwnedElsewhere,
    grpc_status_of,
)
from controller.fleet.handover import Handover
from controller.fleet.handshake import describe, handshake, new_scheduler
from controller.fleet.health import HealthMonitor
from controller.fleet.ownership import retry_delay
from controller.fleet.placed import PlacedRequests
from controller.fleet.placement import StepCostModel
from controller.fleet.session_view import SessionState, SessionView
from controller.fleet.steps import StepLoop
from controller.fleet.tracked import Tracked, count_finished

if TYPE_CHECKING:
    from common.wire.config import DeviceInfo
    from controller.core.scheduler import SchedulerBase
    from controller.fleet.owner import SessionOwner
    from controller.observe.metrics import EngineMetrics, ExecutorSeries
    from controller.settings import ControllerConfig

log = logging.getLogger(__name__)


class ExecutorSession(SessionView, StepLoop, Handover):
    """One executor: client, health checks, scheduler and the step loop that drives it (its
    base classes: the step loop, steps.py; what it shows placement and reports,
    session_view.py; following the division between controllers, handover.py)."""

    def __init__(
        self,
        owner: SessionOwner,
        config: ControllerConfig,
        metrics: EngineMetrics,
        address: str,
        source: str = "static",
        security: ChannelSecurity | None = None,
        owner_id: str = "",
    ):
        self.owner = owner  # told about readiness, finished and moved requests, the end
        self.config = config  # controller configuration
        self.metrics = metrics  # where its events are counted
        self.address = address  # host:port
        self.source = source  # how it was found: static, dns or file
        self.client = ExecutorClient(
            address, config.step_timeout, security, owner_id, config.executor_lease_seconds
        )
        self.scheduler: SchedulerBase | None = None  # rebuilt by every handshake
        self.info: DeviceInfo | None = None  # the latest InitDevice answer
        self.num_blocks = 0  # KV blocks on the device
        self.max_num_batched_tokens = 0  # this executor's step budget
        self.state = SessionState.CONNECTING  # see SessionState
        self.state_since = time.monotonic()  # when state last changed
        self.leaving = False  # left discovery: drain, then stop
        self.tracked = PlacedRequests()  # requests placed here, by id
        self.cost = StepCostModel()  # measured step times
        self.last_loss = ""  # why it was last lost
        self.connect_error = ""  # why the current connection attempts fail ("" once connected)
        self.duplicate_of = ""  # the address driving the same executor, while a duplicate
        self.owned_by = ""  # the other controller holding the executor, while it refuses us
        self.incarnations = 0  # distinct incarnation ids seen
        self.losses = 0  # times lost
        self.reconnects = 0  # handshakes after a loss
        self.requests_placed = 0  # requests placed here (moves included)
        self.steps = 0  # steps run
        self.tokens = 0  # tokens computed
        self._base_prefix = (0, 0)  # prefix-cache (queries, hits) of earlier connections
        self._series: ExecutorSeries | None = None  # bound on first use (see `series`)
        self._wake = asyncio.Event()  # set when work arrives or the session must end
        self.health = HealthMonitor(
            self.client,
            config.health_check_interval,
            config.health_check_timeout,
            config.health_check_failures,
            on_lost=self._wake.set,
        )  # judges the session lost
        self._task: asyncio.Task | None = None  # the lifecycle
        self._backoff = config.reconnect_backoff_min  # wait before the next attempt
        self.assigned_to = ""  # the controller the division gave it ("" = this one)
        self._reassigned = asyncio.Event()  # set when `assigned_to` changes
        self._drain_timer: asyncio.TimerHandle | None = None  # ends a hand-over's drain
        self.handover_expired = False  # the hand-over's drain ran out (the loop ended on purpose)

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
        if self.state is SessionState.HEALTHY:
            self._set_state(SessionState.DRAINING)
        self._wake.set()
        if self.state is not SessionState.DRAINING and self._task is not None:
            self._task.cancel()  # not connected: nothing to drain (it holds no request)

    def rejoin(self) -> bool:
        """The address is back in discovery while draining: take work again."""
        if not self.leaving or self.state is not SessionState.DRAINING:
            return False
        self.leaving = False
        self._set_state(SessionState.DRAINING if self.assigned_to else SessionState.HEALTHY)
        return True

    def _set_state(self, state: SessionState) -> None:
        if state is not self.state:
            self.state, self.state_since = state, time.monotonic()

    async def _lifecycle(self) -> None:
        try:
            while not self.leaving:
                self._reassigned.clear()
                if self.assigned_to:  # another controller's: no connection (handover.py)
                    await self._idle_elsewhere()
                    continue
                await self.client.close()  # every attempt starts on a fresh channel
                if await self._connect_or_wait():
                    await self._drive()
        finally:
            self._cancel_drain_timer()
            self._set_state(SessionState.REMOVED)
            self.owner.release_incarnation(self.address)
            self.owner.session_removed(self.address)
            await self.client.release_session(self.config.health_check_timeout)
            await self.client.close()

    async def _connect_or_wait(self) -> bool:
        """One connection attempt; False after waiting for the next one (the other owner's
        lease, or the backoff after a failure)."""
        cfg = self.config
        try:
            await self._connect()
        except OwnedElsewhere as exc:  # not a failure: wait for its lease
            await self._pause(self._owned_elsewhere(exc))
            return False
        except Exception as exc:  # not up yet, or failing: retry
            self._count_failure(exc)
            error = repr(exc)[:300]
            level = logging.INFO if error != self.connect_error else logging.DEBUG
            log.log(level, "executor %s: not connected (%s); retrying", self.address, error)
            self.connect_error = error
            await self._pause(self._backoff)
            self._backoff = min(self._backoff * 2, cfg.reconnect_backoff_max)
            return False
        self.owned_by = ""
        self._backoff = cfg.reconnect_backoff_min
        return True

    async def _drive(self) -> None:
        """Run the step loop of a connected session until it is lost, drained (the address
        left) or handed over to another controller."""
        self.health.start()
        try:
            await self._run_steps()  # returns once drained
            # Drained: too late to rejoin, or to take work before the next handshake.
            self._set_state(SessionState.REMOVED if self.leaving else SessionState.CONNECTING)
        except ExecutorLost as exc:
            expired, self.handover_expired = self.handover_expired, False
            if not expired:
                self._count_failure(exc)
            self._on_lost(str(exc), counted=not expired)
        except Exception as exc:  # a bug must not strand the requests placed here
            log.exception("executor %s: step loop failed", self.address)
            self._on_lost(f"step loop failed: {exc!r}")
        finally:
            await self.health.stop()
        if self.assigned_to and not self.leaving:
            self.owner.release_incarnation(self.address)
            self._retire_scheduler()
            await self._release_handed_over()

    def _owned_elsewhere(self, exc: OwnedElsewhere) -> float:
        """Wait as OWNED_ELSEWHERE; the seconds until the next attempt (ownership.retry_delay)."""
        if exc.owner != self.owned_by:
            log.warning(
                "executor %s is owned by controller %s (lease %.1fs left): not taken; "
                "retrying when its lease would expire",
                self.address,
                exc.owner,
                exc.seconds_left,
            )
        self.owned_by = exc.owner
        self.connect_error = str(exc)[:300]
        self._set_state(SessionState.OWNED_ELSEWHERE)
        return retry_delay(exc.seconds_left, self.config)

    def _count_failure(self, exc: BaseException) -> None:
        """Count the gRPC status behind a failure (nothing for other failures)."""
        code = grpc_status_of(exc)
        if code:
            self.metrics.grpc_error(self.series, code)

    async def _connect(self) -> None:
        """Health check, handshake, fresh scheduler; then take work."""
        cfg = self.config
        status = await self.client.check_health(cfg.health_check_timeout)
        if status != "SERVING":
            if status == "UNREACHABLE":  # the health call itself failed
                self.metrics.grpc_error(self.series, status)
            raise ExecutorLost(f"health: {status}")
        self._claim(await self.client.identify(cfg.health_check_timeout))
        hs = await handshake(self.client, cfg)
        if hs.info.incarnation_id:  # restarted since Identify: claim the new process
            self._claim(hs.info.incarnation_id)
        self.owner.check_compatible(self.address, hs.info)
        self.client.packed_steps = hs.info.capabilities.packed_steps
        self.client.step_port = (
            hs.info.capabilities.step_socket_port if cfg.executor_step_socket else 0
        )
        self._retire_scheduler()
        self.scheduler = new_scheduler(cfg, hs.info, hs.num_blocks)
        self.max_num_batched_tokens = self.scheduler.config.max_num_batched_tokens
        restarted = self.info is None or self.info.incarnation_id != hs.info.incarnation_id
        if restarted:
            self.incarnations += 1
        if self.state is not SessionState.CONNECTING:
            self.reconnects += 1
            self.metrics.executor_reconnected(self.series)
        if self.info is not None and (self.info.device_kind, self.info.device_name) != (
            hs.info.device_kind,
            hs.info.device_name,
        ):
            self.cost = StepCostModel()  # another device now answers at this address
        if self.cost.steps == 0:
            prior = self.owner.cost_prior(self.address)
            if prior is not None:
                self.cost.set_prior(*prior)
        self.info, self.num_blocks = hs.info, hs.num_blocks
        self._series = None  # rebound on next use: the accelerator label may have changed
        self.connect_error = ""
        self.metrics.scheduler_reset(self.address)
        log.info(
            "executor %s: %s", self.address, describe(hs, restarted, self.max_num_batched_tokens)
        )
        draining = self.leaving or self.assigned_to  # the step loop hands it over when idle
        self._set_state(SessionState.DRAINING if draining else SessionState.HEALTHY)
        self.owner.session_ready(self.address)

    def _claim(self, incarnation: str) -> None:
        """Drive the executor process `incarnation` ("": it does not say), unless another
        session does: then wait as its duplicate (ExecutorLost, retried with backoff)."""
        holder = self.owner.claim_incarnation(self.address, incarnation) if incarnation else ""
        if holder:
            if self.duplicate_of != holder:
                log.warning(
                    "executor %s is the executor at %s (incarnation %s): not driven twice",
                    self.address,
                    holder,
                    incarnation[:8],
                )
            self.duplicate_of = holder
            self._set_state(SessionState.DUPLICATE)
            raise ExecutorLost(f"the same executor as {holder} (incarnation {incarnation[:8]})")
        self.duplicate_of = ""
        if self.state is SessionState.DUPLICATE:
            self._set_state(SessionState.CONNECTING)

    def _on_lost(self, reason: str, counted: bool = True) -> None:
        """Hand every request back to the owner (it moves them) and drop the connection's
        scheduler; `counted`: a loss of the executor (not a hand-over's drain running out).

        Synchronous on purpose: no request can be left between two owners. The channel is
        closed by the next connection attempt.
        """
        log.warning(
            "executor %s %s: %s; moving %d requests",
            self.address,
            "lost" if counted else "handed over",
            reason,
            len(self.tracked),
        )
        if counted:
            self.losses += 1
            self.last_loss = reason[:300]
            self.metrics.executor_lost(self.series)
        self._set_state(SessionState.UNHEALTHY)
        self.owner.release_incarnation(self.address)
        moved = list(self.tracked.values())
        for tracked in moved:
            self.tracked.remove(tracked)
        self._retire_scheduler()
        if moved:
            self.metrics.failed_over(self.series, len(moved))
        self.owner.relocate(moved, self.address)

    def _retire_scheduler(self) -> None:
        """Drop the connection's scheduler (its blocks mean nothing now), keeping its
        counters."""
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
        self.tracked.place(tracked, self.address)
        self.requests_placed += 1
        self._wake.set()

    def withdraw(self, tracked: Tracked) -> None:
        """Take back a request that was never admitted here (to place it elsewhere)."""
        if self.scheduler is not None:
            self.scheduler.finish_requests([tracked.gen.request_id], "abort")
        self.tracked.remove(tracked)

    def abort(self, tracked: Tracked, reason: str = "abort") -> None:
        """The client went away (or, `reason` "stop", a stream writer found a stop string):
        finish the request and free its blocks."""
        if tracked.gen.request_id not in self.tracked:
            return
        if self.scheduler is not None:
            self.scheduler.finish_requests([tracked.gen.request_id], reason)
        self.tracked.remove(tracked)
        why = "client gone" if reason == "abort" else f"{reason}, by its stream writer"
        log.info("request %s aborted (%s)", tracked.gen.request_id, why, extra=tracked.log_extra)
        count_finished(self.metrics, reason, tracked, series=self.series)
        self._wake.set()
