"""Bounding each write to a client by --stream-stall-timeout, at one timer per response.

uvicorn's send waits while the socket's buffers are full, so a client that stops reading (or a
half-open connection) makes a write wait; past the timeout the response is aborted
(streaming.py), which aborts its sequences in the engine and frees their KV blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from fastapi.responses import StreamingResponse

log = logging.getLogger(__name__)


class ClientStalled(Exception):
    """A write to the client did not complete within the stall timeout."""

    def __init__(self, timeout: float):
        super().__init__(f"the client read nothing for {timeout:g}s")
        self.timeout = timeout  # the stall timeout that ran out


class StallGuard:
    """`send` that raises ClientStalled when one message takes longer than `timeout` seconds.

    One timer per response, re-armed when it fires rather than on every send: a send costs two
    attribute writes, where a timeout per send cost a timer in the loop's heap per chunk. The
    timer fires at `timeout` after the send in progress began (or after it last fired, when
    idle), so a stalled send is cut at exactly its bound, as a per-send timeout would.
    """

    def __init__(self, send: Callable, timeout: float):
        self._send = send  # the server's send
        self.timeout = timeout  # seconds one message may take
        self._loop: asyncio.AbstractEventLoop | None = None  # bound at the first send
        self._since = 0.0  # loop time the send in progress began; 0.0: none in progress
        self._task: asyncio.Task | None = None  # the task of the send in progress
        self._timer: asyncio.TimerHandle | None = None  # the watchdog, while the response runs
        self._expired = False  # the watchdog cancelled the send in progress

    async def __call__(self, message: dict) -> None:
        loop = self._loop
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._timer = loop.call_at(loop.time() + self.timeout, self._check)
        self._task = asyncio.current_task(loop)
        self._since = loop.time()
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if self._expired and self._task is not None:
                self._task.uncancel()
                raise ClientStalled(self.timeout) from None
            raise
        finally:
            self._since = 0.0

    def _check(self) -> None:
        """The watchdog: cut a send older than the timeout, else fire again when the one in
        progress (or the next one) could first be."""
        assert self._loop is not None
        since, now = self._since, self._loop.time()
        if since and now - since >= self.timeout and self._task is not None:
            self._expired, self._timer = True, None
            self._task.cancel()
            return
        self._timer = self._loop.call_at((since or now) + self.timeout, self._check)

    def close(self) -> None:
        """The response is over: stop the watchdog."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def guarded(send: Callable, timeout: float) -> Callable:
    """`send` that raises ClientStalled when one message takes longer than `timeout` seconds
    (0: no bound; a StallGuard, to close when the response is over)."""
    if not timeout:
        return send
    return StallGuard(send, timeout)


def close_guard(send: Callable) -> None:
    """Stop a guarded send's watchdog (nothing for an unguarded one)."""
    if isinstance(send, StallGuard):
        send.close()


class StallBoundedStream(StreamingResponse):
    """A streamed response whose every write waits at most `stall_timeout` seconds for the
    client (one StallGuard, stopped when the response is over); a stalled one is aborted, and
    its body iterator is closed however it ends (what it holds goes back now, not when it is
    collected). Subclasses set `stall_timeout` and say what else ends with it (`finished`)."""

    stall_timeout: float  # seconds one write may wait for the client
    kind = "streamed"  # the response's kind, in the stall's log line

    async def stream_response(self, send) -> None:
        guard = guarded(send, self.stall_timeout)
        try:
            await super().stream_response(guard)
        finally:
            close_guard(guard)

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except ClientStalled as stalled:
            # uvicorn closes the connection of a response that did not complete.
            log.warning("%s: the %s response is aborted", stalled, self.kind)
        finally:
            with contextlib.suppress(Exception):
                await self.body_iterator.aclose()
            await self.finished()

    async def finished(self) -> None:
        """What the response releases once it is over, however it ended."""
