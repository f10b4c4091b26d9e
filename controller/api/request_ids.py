"""Request ids: the client's X-Request-Id (or a generated one) on every response and log line.

`RequestIdMiddleware`, the outermost middleware, takes the id from the request's X-Request-Id
header (at most 128 characters of a safe charset; anything else is a 400 naming the header,
answered under a fresh id, so nothing the client sent is echoed), or generates one when the
header is absent. It returns the id in the X-Request-Id header of every response (errors of
the inner middlewares and handlers included), binds it to the logging context for the
request's task (common.logs), and hands the handlers a `RequestIds` in the ASGI scope.

Response ids (``cmpl-<id>``) and sequence ids (common.wire.request_ids) derive from
`RequestIds.unique`: the id itself, or ``<id>~<k>`` while another response with the same id
is in flight, so that two clients sending the same id never share a sequence id.
"""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import dataclass

from common.logs import bound_request_id
from common.wire.request_ids import CLASH_MARK
from controller.api.errors import APIError, error_response

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# Characters that need no quoting in headers, URLs or log lines (no CLASH_MARK among them).
_VALID = re.compile(rf"[A-Za-z0-9._:/+=-]{{1,{MAX_LENGTH}}}")
_HEADER_KEY = HEADER.lower().encode("ascii")
SCOPE_KEY = "tandem.request_ids"  # where handlers find the RequestIds in the ASGI scope


@dataclass(frozen=True)
class RequestIds:
    """The ids of one HTTP request."""

    public: str  # returned in X-Request-Id and on log records: the client's or a generated one
    unique: str  # `public`, or `public~k` while another response has it; ids derive from it


def new_request_id() -> str:
    """A fresh id (32 hex digits)."""
    return uuid.uuid4().hex


def request_ids(scope: dict) -> RequestIds:
    """The ids the middleware gave this request (fresh ones when it did not run)."""
    ids = scope.get(SCOPE_KEY)
    if ids is None:
        rid = new_request_id()
        ids = RequestIds(rid, rid)
    return ids


def _client_id(scope: dict) -> tuple[str | None, str]:
    """(the valid X-Request-Id or None, why the header is refused or "")."""
    values = [v for k, v in scope.get("headers", ()) if k == _HEADER_KEY]
    if not values:
        return None, ""
    if len(values) > 1:
        return None, f"Send at most one {HEADER} header."
    value = values[0].decode("latin-1")
    if not _VALID.fullmatch(value):
        return None, (
            f"The {HEADER} header must be 1 to {MAX_LENGTH} characters among A-Z, a-z, 0-9 "
            "and . _ : / + = -"
        )
    return value, ""


class InFlightIds:
    """Request ids of the responses in flight, to rename a clash."""

    def __init__(self) -> None:
        self._count: dict[str, int] = {}  # public id -> responses in flight under it
        self._serial = itertools.count(1)  # suffixes: never reused, so never clash

    def claim(self, public: str) -> str:
        """The unique id of a new response under ``public``."""
        held = self._count.get(public, 0)
        self._count[public] = held + 1
        return public if not held else f"{public}{CLASH_MARK}{next(self._serial)}"

    def release(self, public: str) -> None:
        """A response under ``public`` is over."""
        held = self._count.pop(public, 1) - 1
        if held:
            self._count[public] = held


class RequestIdMiddleware:
    """ASGI middleware: validates or generates the request id, returns it on every response,
    and binds it to the logging context while the request is served."""

    def __init__(self, app):
        self.app = app  # the wrapped ASGI app
        self.in_flight = InFlightIds()  # ids of the responses being served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given, problem = _client_id(scope)
        public = given or new_request_id()
        header = (_HEADER_KEY, public.encode("ascii"))

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), header]}
            await send(message)

        with bound_request_id(public):
            if problem:
                err = APIError(problem, 400, HEADER, "invalid_request_id")
                await error_response(err)(scope, receive, send_with_id)
                return
            scope[SCOPE_KEY] = RequestIds(public, self.in_flight.claim(public))
            try:
                await self.app(scope, receive, send_with_id)
            finally:
                self.in_flight.release(public)
