"""A bound on the time a request's body may take to arrive (408 beyond it), as ASGI middleware.

uvicorn hands the app a request as soon as its headers are in and waits for the body without
end: a client that declares a large Content-Length and then sends a byte a minute holds its
connection, its request task and the buffered bytes for ever. Here the whole body must arrive
within `timeout` seconds of the app being called; a request past it gets 408 (OpenAI's error
shape, `connection: close`) and whatever the app below does with the cut-short body is
dropped. Once the body is complete, later receive calls (a streaming response waiting for the
client to leave) are not bounded.
"""

from __future__ import annotations

import asyncio

from controller.api.errors import APIError, error_response
from controller.api.http_guard import HTTPStats


def _timeout_error(timeout: float) -> APIError:
    return APIError(
        f"The request body did not arrive within {timeout:g} seconds.",
        408,
        code="request_timeout",
        headers={"connection": "close"},
    )


class _BodyClock:
    """The receive and send callables of one request: receive bounded until the body is in,
    send muted once the body timed out (the middleware answers instead)."""

    def __init__(self, receive, send, deadline: float):
        self._receive = receive  # the server's receive
        self._send = send  # the server's send
        self.deadline = deadline  # event-loop time by which the body must be complete
        self.body_done = False  # the last body chunk (or a disconnect) has been received
        self.timed_out = False  # the deadline passed first
        self.started = False  # the app below began its response

    async def receive(self):
        if self.body_done:
            return await self._receive()
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.001))
        except TimeoutError:
            self.timed_out = self.body_done = True
            return {"type": "http.disconnect"}  # the app below stops reading
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.body_done = True
        return message

    async def send(self, message) -> None:
        if self.timed_out and not self.started:
            return  # the 408 goes out instead of whatever the app makes of the disconnect
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class BodyReadTimeout:
    """Answer 408 when a request's body is not complete `timeout` seconds after its headers."""

    def __init__(self, app, timeout: float, stats: HTTPStats | None = None):
        self.app = app  # the wrapped ASGI app
        self.timeout = timeout  # seconds for the whole body; 0 = no bound
        self.stats = stats  # counts the timeouts (tandem:http_connections_closed_total)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.timeout:
            await self.app(scope, receive, send)
            return
        deadline = asyncio.get_running_loop().time() + self.timeout
        clock = _BodyClock(receive, send, deadline)
        try:
            await self.app(scope, clock.receive, clock.send)
        except Exception:
            if not clock.timed_out:
                raise
            # The app below failed on the cut-short body: the 408 below says why.
        if clock.timed_out and not clock.started:
            if self.stats is not None:
                self.stats.closed["body_timeout"] += 1
            await error_response(_timeout_error(self.timeout))(scope, receive, send)
