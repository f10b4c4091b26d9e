"""Handing an executor over to the controller the division chose for it (peers.py).

With peers, each executor session is told which live controller the executor belongs to
(`assign`: "" = this one). A session whose executor is another controller's does not connect:
it waits as ASSIGNED_ELSEWHERE, its state visible in /admin/executors. A connected session whose
executor becomes another controller's hands it over: it turns DRAINING (no new request is placed
on it; the maintenance pass moves its unadmitted ones), lets its running requests finish for up
to `handover_drain_timeout` seconds, then moves whatever still runs by the failover path (they
resume by recompute elsewhere: none is lost) and releases the executor's session
(ReleaseSession), so that the chosen controller's next attempt takes it at once. Given back
before that, it takes new work again. `ExecutorSession` inherits `Handover`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from controller.fleet.session_view import SessionState

if TYPE_CHECKING:
    from controller.fleet.client import ExecutorClient
    from controller.fleet.health import HealthMonitor
    from controller.fleet.placed import PlacedRequests
    from controller.settings import ControllerConfig

log = logging.getLogger(__name__)


class Handover:
    """How one executor session follows the division (`ExecutorSession` inherits it). It works
    on the session's attributes declared here."""

    address: str  # host:port
    config: ControllerConfig  # handover_drain_timeout, health_check_timeout
    client: ExecutorClient  # releases the executor's session
    health: HealthMonitor  # ends the step loop when the drain runs out
    state: SessionState  # where it stands
    leaving: bool  # left discovery
    tracked: PlacedRequests  # requests placed here
    assigned_to: str  # the controller the division gave the executor ("" = this one)
    _wake: asyncio.Event  # wakes the step loop
    _reassigned: asyncio.Event  # set when `assigned_to` changes
    _drain_timer: asyncio.TimerHandle | None  # ends a hand-over's drain
    handover_expired: bool  # the drain ran out: the step loop ended on purpose

    def _set_state(self, state: SessionState) -> None:
        raise NotImplementedError

    def assign(self, controller: str) -> None:
        """The division gives the executor to `controller` ("" = this controller)."""
        if controller == self.assigned_to:
            return
        self.assigned_to = controller
        self._reassigned.set()
        if controller:
            driving = self.state is SessionState.HEALTHY
            log.info(
                "executor %s belongs to controller %s%s",
                self.address,
                controller,
                f": handing it over ({len(self.tracked)} requests)" if driving else "",
            )
            if driving:
                self._set_state(SessionState.DRAINING)
                self._start_drain_timer()
                self._wake.set()
            return
        log.info("executor %s belongs to this controller", self.address)
        self._cancel_drain_timer()
        if self.state is SessionState.DRAINING and not self.leaving:
            self._set_state(SessionState.HEALTHY)

    def _start_drain_timer(self) -> None:
        self._cancel_drain_timer()
        self._drain_timer = asyncio.get_running_loop().call_later(
            self.config.handover_drain_timeout, self._drain_expired
        )

    def _cancel_drain_timer(self) -> None:
        if self._drain_timer is not None:
            self._drain_timer.cancel()
            self._drain_timer = None

    def _drain_expired(self) -> None:
        """The drain ran out with requests still here: end the step loop (they move)."""
        self._drain_timer = None
        if self.assigned_to and self.state is SessionState.DRAINING and not self.leaving:
            self.handover_expired = True
            self.health.declare_lost(
                f"the {self.config.handover_drain_timeout:g}s drain ran out with "
                f"{len(self.tracked)} requests here (the executor goes to {self.assigned_to})"
            )

    async def _pause(self, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when the assignment changes (the lifecycle
        clears `_reassigned` before each attempt, so a change during one is not missed)."""
        try:
            await asyncio.wait_for(self._reassigned.wait(), seconds)
        except TimeoutError:
            pass

    async def _idle_elsewhere(self) -> None:
        """Wait, unconnected, while the executor is another controller's."""
        self._set_state(SessionState.ASSIGNED_ELSEWHERE)
        while self.assigned_to and not self.leaving:
            self._reassigned.clear()
            await self._pause(3600.0)
        if not self.leaving:
            self._set_state(SessionState.CONNECTING)

    async def _release_handed_over(self) -> None:
        """The step loop ended for a hand-over: release the executor so the chosen controller
        takes it at once, and drop the connection."""
        self._cancel_drain_timer()
        await self.client.release_session(self.config.health_check_timeout)
        await self.client.close()
        log.info("executor %s handed over to controller %s", self.address, self.assigned_to)
