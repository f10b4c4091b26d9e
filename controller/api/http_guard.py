"""The controller's HTTP connections, bounded: how many may be open, how long a client may take
to send a request's line and headers, and how large they may be.

uvicorn's HTTP/1.1 protocol (httptools) accepts every connection and waits for a request head
without end and without a size bound: a few thousand sockets that send nothing (or one byte a
second) exhaust the process's file descriptors, and one endless header grows its memory. This
subclass adds, per connection:

- a cap at accept: beyond `max_connections` open ones a new connection gets 503 and is closed
  before it is read (uvicorn's `limit_concurrency` only answers once a request's headers are
  complete, which a slow or silent client never reaches);
- a head timer: from the accept (or, on a keep-alive connection, from the first byte of its next
  request) the request line and headers must be complete within `header_timeout`, else the
  connection is closed (with a 408 if the client sent anything);
- a head size bound: more than `max_header_bytes` of request line and headers gets 431.

The body's own timeout is an ASGI middleware (`controller/api/body_timeout.py`); the keep-alive
idle timeout is uvicorn's. Counts go to `HTTPStats`, exported as metrics.
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from controller.api.direct_write import EXTENSION, DirectWrite
from controller.api.errors import APIError, error_body, error_response

# Why the server closed a connection early (the label of tandem:http_connections_closed_total).
CLOSE_REASONS = ("over_limit", "header_timeout", "header_too_large", "body_timeout")


@dataclass(frozen=True)
class HTTPLimits:
    """Per-connection bounds of the HTTP server (0 = no bound, each)."""

    max_connections: int = 0  # open connections; a new one beyond them gets 503 and is closed
    max_header_bytes: int = 0  # request line plus headers; more gets 431
    header_timeout: float = 0.0  # seconds to send the request line and headers; then closed


@dataclass
class HTTPStats:
    """What the guard has seen, for metrics and tests (the event loop's thread only)."""

    open: int = 0  # connections open now (accepted, not yet closed)
    closed: Counter = field(default_factory=Counter)  # early closes by reason (CLOSE_REASONS)


def raw_error(err: APIError) -> bytes:
    """A whole HTTP/1.1 response for `err` (OpenAI's error shape, `error_body`), closing the
    connection: for answers given below the ASGI app (no request object exists yet)."""
    body = json.dumps({"error": error_body(err)}).encode()
    headers = {
        "content-type": "application/json",
        "content-length": str(len(body)),
        "connection": "close",
        **err.headers,
    }
    lines = [
        f"HTTP/1.1 {err.status} {HTTPStatus(err.status).phrase}",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("ascii") + body


_OVER_LIMIT = raw_error(
    APIError(
        "The server has too many open connections; retry later.",
        503,
        code="too_many_connections",
        headers={"retry-after": "1"},
    )
)
_HEAD_TIMEOUT = raw_error(
    APIError("The request line and headers did not arrive in time.", 408, code="request_timeout")
)


def _head_too_large(limit: int) -> APIError:
    """431 for a request line plus headers over `limit` bytes (closing the connection)."""
    return APIError(
        f"The request line and headers are larger than {limit} bytes.",
        431,
        code="headers_too_large",
        headers={"connection": "close"},
    )


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap, a head timer and a head size bound.
    Build a class bound to one server's limits with `guarded_protocol`."""

    limits: ClassVar[HTTPLimits] = HTTPLimits()  # the bounds (set by guarded_protocol)
    stats: ClassVar[HTTPStats]  # shared counters (set by guarded_protocol)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._refused = False  # answered 503 at accept: never served
        self._reading_head = False  # a request line and headers are being received
        self._in_message = False  # the parser is inside a request (head or body)
        self._head_bytes = 0  # bytes received since the head being read began
        self._head_timer: asyncio.TimerHandle | None = None  # closes a head that takes too long

    # --- accept and close ---------------------------------------------------------------

    def connection_made(self, transport) -> None:  # type: ignore[override]
        cap = self.limits.max_connections
        if cap and len(self.connections) >= cap:
            self._refused = True
            self.transport = transport
            self.stats.closed["over_limit"] += 1
            transport.write(_OVER_LIMIT)
            transport.close()
            return
        super().connection_made(transport)
        self.stats.open += 1
        self._begin_head()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:
            return
        self.stats.open -= 1
        self._cancel_head_timer()
        super().connection_lost(exc)

    # --- the request head ---------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        if not self._reading_head and not self._in_message and self._between_requests():
            self._begin_head()  # the first byte of a keep-alive connection's next request
        if self._reading_head:
            self._head_bytes += len(data)
        super().data_received(data)
        limit = self.limits.max_header_bytes
        if self._reading_head and limit and self._head_bytes > limit:
            # Still no end of headers after more than the limit: refuse before buffering more.
            self._close_head("header_too_large", raw_error(_head_too_large(limit)))

    def on_message_begin(self) -> None:
        self._in_message = True
        if not self._reading_head:
            self._begin_head()  # a pipelined request
        super().on_message_begin()

    def on_headers_complete(self) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        limit = self.limits.max_header_bytes
        size = len(self.url) + sum(len(n) + len(v) + 4 for n, v in self.headers)
        if not limit or size <= limit:
            super().on_headers_complete()
            self._offer_direct_write()
            return
        # The whole head came in one read but is too large: answer through uvicorn's own
        # request cycle, so that the parser's state stays consistent.
        self.stats.closed["header_too_large"] += 1
        app, self.app = self.app, error_response(_head_too_large(limit))
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _offer_direct_write(self) -> None:
        """Name the new request's cycle in its scope, for the step loop's direct writes of
        streamed chunks (`direct_write.py`); the app's task has not started yet."""
        if self.cycle is None:
            return
        scope: Any = self.scope
        extensions = scope.get("extensions")
        if extensions is None:
            extensions = scope["extensions"] = {}
        extensions[EXTENSION] = DirectWrite(self.cycle)

    def on_message_complete(self) -> None:
        self._in_message = False
        super().on_message_complete()

    def _between_requests(self) -> bool:
        return self.cycle is None or self.cycle.response_complete

    def _begin_head(self) -> None:
        self._reading_head = True
        self._head_bytes = 0
        timeout = self.limits.header_timeout
        if timeout and self._head_timer is None:
            self._head_timer = self.loop.call_later(timeout, self._head_timed_out)

    def _cancel_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        # A connection that never sent a byte gets no answer: there is no request to answer.
        self._close_head("header_timeout", _HEAD_TIMEOUT if self._head_bytes else b"")

    def _close_head(self, reason: str, response: bytes) -> None:
        self._reading_head = False
        self._cancel_head_timer()
        if self.transport.is_closing():
            return
        self.stats.closed[reason] += 1
        if response:
            self.transport.write(response)
        self.transport.close()


def guarded_protocol(limits: HTTPLimits, stats: HTTPStats) -> type[GuardedHttpToolsProtocol]:
    """The protocol class uvicorn builds per connection (`uvicorn.Config(http=...)`), bound to
    these limits and counters."""
    attrs = {"limits": limits, "stats": stats}
    return type("GuardedHttpToolsProtocol", (GuardedHttpToolsProtocol,), attrs)
