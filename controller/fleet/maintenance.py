"""The engine's maintenance pass: requests waiting for an executor (those moved off a lost
executor among them), and the affinity bound.

A request moved off a lost executor waits `FAILOVER_SETTLE` before it is placed (`relocate`).
Every `MAINTAIN_PERIOD` seconds, and at once when a session becomes ready, the pass places the
requests waiting for a healthy executor (failing those past `no_executor_timeout`), moves every
request a draining executor has not admitted elsewhere, and moves requests an executor has held
unadmitted past `affinity_max_wait` to one that can start them now, so that prefix affinity or
a stale estimate never holds a request back long. `Engine` (engine.py) inherits `Maintenance`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

from controller.fleet.session import SessionState

if TYPE_CHECKING:
    from controller.fleet.session import ExecutorSession
    from controller.fleet.tracked import Tracked
    from controller.observe.metrics import EngineMetrics
    from controller.settings import ControllerConfig

log = logging.getLogger(__name__)

MAINTAIN_PERIOD = 0.2  # seconds between passes over waiting and stuck requests
# Seconds a request taken off a lost executor waits before it is placed again: long enough for
# the losses of executors that die together (a process, a host: their streams break within
# milliseconds of each other) to be seen first, short next to a resume by recompute.
FAILOVER_SETTLE = 0.25


class Maintenance:
    """The maintenance loop of the engine (`Engine` inherits it). It works on the engine's
    attributes declared here, and places requests through the engine's methods below."""

    config: ControllerConfig  # no_executor_timeout, affinity_max_wait, max_request_moves
    metrics: EngineMetrics  # counts the rebalanced requests
    sessions: dict[str, ExecutorSession]  # the fleet, by address
    waiting: dict[str, Tracked]  # requests waiting for a healthy executor (or settling)
    _kick: asyncio.Event  # set to run a pass at once

    def _place_or_fail(
        self, tracked: Tracked, exclude: str | None = None, startable_only: bool = False
    ) -> bool:
        """Place a request, or fail it alone (True), or find no executor for it (False)."""
        raise NotImplementedError

    def _place_or_wait(self, tracked: Tracked) -> None:
        """Place a request, or fail it alone, or let it wait for an executor."""
        raise NotImplementedError

    def _fail_waiting(self, tracked: Tracked) -> None:
        """A waiting request found no healthy executor in time: fail it (503)."""
        raise NotImplementedError

    def _fail_alone(self, tracked: Tracked, error: str) -> None:
        """End a request on no executor with an error to its client (500)."""
        raise NotImplementedError

    def relocate(self, moved: list[Tracked], source: str) -> None:
        """Place requests taken from the lost executor at `source` elsewhere; they resume by
        recompute."""
        now = time.perf_counter()
        limit = self.config.max_request_moves
        for tracked in moved:
            tracked.num_failovers += 1
            if tracked.num_failovers > limit:  # it may be what takes executors down
                self._fail_alone(
                    tracked,
                    f"the request's executor was lost {tracked.num_failovers} times while it "
                    f"ran; it is not moved more than {limit} times",
                )
                continue
            tracked.num_moves += 1
            tracked.prompt_logprobs_skip = tracked.prompt_logprobs_sent
            tracked.lost_at = tracked.lost_at or now
            # Held for FAILOVER_SETTLE before it is placed: executors that die together (one
            # process or host) are found lost one by one, and a request placed at once could
            # land on a sibling whose loss is not seen yet and count a loss it did not cause.
            tracked.waiting_since = time.monotonic()
            tracked.hold_until = tracked.waiting_since + FAILOVER_SETTLE
            self.waiting[tracked.gen.request_id] = tracked
        if moved:
            asyncio.get_running_loop().call_later(FAILOVER_SETTLE, self._kick.set)
        log.info(
            "failover from %s: %d requests to move in %.2fs, %d waiting for an executor",
            source,
            len(moved),
            FAILOVER_SETTLE,
            len(self.waiting),
        )

    async def _maintain(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._kick.wait(), timeout=MAINTAIN_PERIOD)
            except TimeoutError:
                pass
            self._kick.clear()
            try:
                self._place_waiting()
                self._rebalance()
            except Exception:  # never let one bad pass stop the loop
                log.exception("maintenance pass failed")

    def _place_waiting(self) -> None:
        if not self.waiting:
            return
        now = time.monotonic()
        for rid, tracked in sorted(self.waiting.items(), key=lambda kv: kv[1].waiting_since):
            if tracked.hold_until > now:  # just taken off a lost executor: settling
                continue
            placed = self._place_or_fail(tracked)
            if placed:
                del self.waiting[rid]
            elif now - tracked.waiting_since >= self.config.no_executor_timeout:
                del self.waiting[rid]
                log.warning(
                    "request %s failed: no healthy executor for %.0fs",
                    rid,
                    now - tracked.waiting_since,
                    extra=tracked.log_extra,
                )
                self._fail_waiting(tracked)

    def _rebalance(self) -> None:
        """Move requests an executor has held unadmitted past the bound to one that can
        start them now (so affinity, or a stale estimate, never holds a request back long),
        and every unadmitted request off a draining executor."""
        healthy = [s for s in self.sessions.values() if s.healthy]
        for session in self.sessions.values():
            if session.state is SessionState.DRAINING and healthy:
                for tracked in session.stale_waiting(float("inf")):
                    session.withdraw(tracked)
                    self.metrics.rebalanced()
                    self._place_or_wait(tracked)
        if len(healthy) < 2:
            return
        cutoff = time.monotonic() - self.config.affinity_max_wait
        for session in healthy:
            for tracked in session.stale_waiting(cutoff):
                n = tracked.request.num_tokens if tracked.request else 0
                if not any(o is not session and o.can_start_now(n) for o in healthy):
                    break
                session.withdraw(tracked)
                tracked.num_moves += 1
                self.metrics.rebalanced()
                if not self._place_or_fail(tracked, session.address, startable_only=True):
                    self._place_or_wait(tracked)
