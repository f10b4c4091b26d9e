"""Graceful shutdown of the controller's HTTP server.

On the first SIGTERM (or SIGINT) the controller stops admitting requests (new ones get 503 and
/health answers 503, so load balancers move away), lets open responses finish for up to
`grace` seconds, then ends the rest with finish_reason "abort" (streams get a final chunk and
[DONE]) and only then lets uvicorn close connections and stop the engine. A second signal
stops at once, as uvicorn does by itself.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

from controller.api.admission import Admission

log = logging.getLogger(__name__)

FLUSH_SECONDS = 5  # how long aborted responses get to send their last chunk
CLOSE_SECONDS = 10  # then how long uvicorn waits for connections and tasks to end
# After SIGTERM the process needs at most --shutdown-grace + SHUTDOWN_EXTRA_SECONDS (the flush,
# the close, and the engine's stop): a supervisor's kill deadline (Kubernetes'
# terminationGracePeriodSeconds; the Helm chart derives it) must be longer.
SHUTDOWN_EXTRA_SECONDS = FLUSH_SECONDS + CLOSE_SECONDS + 5


class GracefulServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains admitted responses before stopping."""

    def __init__(self, config: uvicorn.Config, admission: Admission, grace: float):
        super().__init__(config)
        self.admission = admission  # stops admitting; knows the open responses
        self.grace = grace  # seconds open responses may still run after the signal
        self._signalled = False  # a drain has begun
        self._loop: asyncio.AbstractEventLoop | None = None  # the serving loop
        self._drain_task: asyncio.Task | None = None  # the drain, once begun

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        """Signal handler: drain on the first signal, stop at once on the next."""
        if self._signalled or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)
            return
        self._signalled = True
        self._loop.call_soon_threadsafe(self._begin_drain)

    def _begin_drain(self) -> None:
        self._drain_task = asyncio.create_task(self.drain(), name="shutdown-drain")

    async def drain(self) -> None:
        """Stop admission, wait up to `grace` for open responses, abort the rest, exit."""
        adm = self.admission
        adm.start_draining()
        log.info(
            "shutting down: admitting nothing; %d responses open, %.0fs grace",
            adm.active,
            self.grace,
        )
        if not await adm.wait_idle(self.grace):
            count = adm.abort_all()
            log.warning("shutdown grace over: aborting %d responses", count)
            if not await adm.wait_idle(FLUSH_SECONDS):
                log.warning("%d responses did not end after the abort", adm.active)
        self.should_exit = True
