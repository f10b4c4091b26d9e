"""When is an executor session lost? Background gRPC health checks and a step guard.

A session is lost when its step stream breaks or a step passes `step_timeout` (the client
raises), when `failures` health checks in a row get no answer within `timeout` (a hung or
stopped process, a partition), or at once when the executor reports NOT_SERVING (it is
shutting down). The guard abandons a step in flight the moment the checks give up, so a hung
executor does not hold its requests until the step deadline.

Beside the checks, the monitor renews the session's lease (when the executor granted one)
every third of its length: a renewal the executor refuses (another controller took it) loses
the session at once; one that gets no answer is left to the health checks to judge.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

import grpc

from controller.fleet.client import ExecutorClient, ExecutorLost, LeaseLost

T = TypeVar("T")
log = logging.getLogger(__name__)


class HealthMonitor:
    """Health checks of one executor session, and the guard around its steps."""

    def __init__(
        self,
        client: ExecutorClient,
        interval: float,
        timeout: float,
        failures: int,
        on_lost: Callable[[], None],
    ):
        self.client = client  # the executor's client (its channel carries the checks)
        self.interval = interval  # seconds between checks
        self.timeout = timeout  # seconds one check may take
        self.failures = max(failures, 1)  # unanswered checks in a row that mean "lost"
        self.on_lost = on_lost  # called once when the checks give up (wakes the step loop)
        self.lost = asyncio.Event()  # set once the session is judged lost
        self.reason = ""  # why
        self._task: asyncio.Task | None = None  # the check loop
        self._renewal: asyncio.Task | None = None  # the lease renewal loop, if a lease
        self._guarded: asyncio.Task | None = None  # the task awaiting guarded work, if any
        self._interrupted: asyncio.Task | None = None  # a guarded task cancelled as lost

    def start(self) -> None:
        """Begin checking a new session."""
        self.lost.clear()
        self.reason = ""
        self._interrupted = None
        self._task = asyncio.create_task(self._loop(), name=f"health-{self.client.address}")
        if self.client.granted_seconds > 0:
            self._renewal = asyncio.create_task(
                self._renew(self.client.granted_seconds / 3), name=f"lease-{self.client.address}"
            )

    async def stop(self) -> None:
        tasks = [t for t in (self._task, self._renewal) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._task = self._renewal = None

    async def _renew(self, period: float) -> None:
        """Renew the lease every `period` seconds until the session ends or loses it."""
        while True:
            await asyncio.sleep(period)
            try:
                await self.client.renew_lease(min(self.timeout, period))
            except LeaseLost as exc:
                log.warning("executor %s: %s", self.client.address, exc)
                self.declare_lost(str(exc))
                return
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    return  # an executor of a version without leases
                log.info("executor %s: lease renewal failed: %s", self.client.address, exc.code())
            except (grpc.aio.UsageError, TimeoutError) as exc:
                log.info("executor %s: lease renewal failed: %r", self.client.address, exc)

    def declare_lost(self, reason: str) -> None:
        if not self.lost.is_set():
            self.reason = reason
            self.lost.set()
            if self._guarded is not None:  # abandon the step in flight (see guard)
                self._interrupted = self._guarded
                self._guarded.cancel()
            self.on_lost()

    def check(self) -> None:
        """Raise ExecutorLost if the session was judged lost."""
        if self.lost.is_set():
            raise ExecutorLost(self.reason)

    async def _loop(self) -> None:
        failed = 0
        while True:
            await asyncio.sleep(self.interval)
            status = await self.client.check_health(self.timeout)
            if status == "SERVING":
                failed = 0
            elif status in ("NOT_SERVING", "SERVICE_UNKNOWN"):
                self.declare_lost(f"health check says {status}")
                return
            else:
                failed += 1
                if failed >= self.failures:
                    self.declare_lost(
                        f"no health answer within {self.timeout:g}s, {failed} times in a row"
                    )
                    return

    async def guard(self, work: Awaitable[T]) -> T:
        """`work`'s result, unless the session is judged lost first (then ExecutorLost).

        `work` runs in the caller's task (no task per step): `declare_lost` cancels that task
        while it waits here, and the cancellation is turned into ExecutorLost. One that comes
        from elsewhere (shutdown) stays a cancellation."""
        if self.lost.is_set():
            if asyncio.iscoroutine(work):
                work.close()  # never started
            raise ExecutorLost(self.reason)
        task = asyncio.current_task()
        self._guarded = task
        try:
            return await work
        except asyncio.CancelledError:
            if self._interrupted is task and task is not None:
                self._interrupted = None
                if task.uncancel() == 0:  # nobody else asked to cancel it
                    raise ExecutorLost(self.reason) from None
            raise
        finally:
            self._guarded = None
