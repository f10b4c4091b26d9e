"""Request ids: the client's X-Request-Id (or a generated one) on every response and log line.

`RequestIdMiddleware`, the outermost middleware, takes the id from the request's X-Request-Id
header (at most 128 characters of a safe charset; anything else is a 400 naming the header,
answered under a fresh id, so nothing the client sent is echoed), or generates one when the
header is absent. It returns the id in the X-Request-Id header of every response (errors of
the inner middlewares and handlers included), binds it to the logging context for the
request's task (common.logs), and hands the handlers a `RequestIds` in the ASGI scope.

Response ids are ``cmpl-<id>`` / ``chatcmpl-<id>``. Sequence ids (common.wire.request_ids)
derive from `RequestIds.unique`: a generated id as is, a client's id as ``<id>~<k>`` with a
serial k of this process. A client may send the same id twice at once, or again right after
an abort, while steps of the first request are still in flight; the scheduler, the fleet and
the executor key a sequence's state and results by its id, so a sequence id is never reused.
"""

from __future__ import annotations

import itertools
import re
import uuid
from dataclasses import dataclass

from common.logs import bound_request_id
from common.wire.request_ids import SERIAL_MARK
from controller.api.errors import APIError, error_response

HEADER = "X-Request-Id"
MAX_LENGTH = 128
# Characters that need no quoting in headers, URLs or log lines (no SERIAL_MARK among them).
_VALID = re.compile(rf"[A-Za-z0-9._:/+=-]{{1,{MAX_LENGTH}}}")
_HEADER_KEY = HEADER.lower().encode("ascii")
SCOPE_KEY = "tandem.request_ids"  # where handlers find the RequestIds in the ASGI scope
# Makes clients' ids unique (they may repeat); one per process, whatever the apps.
_SERIAL = itertools.count(1)


@dataclass(frozen=True)
class RequestIds:
    """The ids of one HTTP request."""

    public: str  # the client's id or a generated one: X-Request-Id, response ids, log records
    unique: str  # never reused in this process: sequence ids derive from it


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


class RequestIdMiddleware:
    """ASGI middleware: validates or generates the request id, returns it on every response,
    and binds it to the logging context while the request is served."""

    def __init__(self, app):
        self.app = app  # the wrapped ASGI app

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
            unique = f"{given}{SERIAL_MARK}{next(_SERIAL)}" if given else public
            scope[SCOPE_KEY] = RequestIds(public, unique)
            await self.app(scope, receive, send_with_id)
