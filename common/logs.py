"""Logging for every Tandem process: one setup call, text or JSON lines on stderr.

A record *concerns a request* when it carries a ``request_id``. It gets one in either of two
ways: explicitly (``log.info(..., extra={"request_id": rid})``, for lines logged away from the
request's own task: a step loop, a gRPC thread), or from the ``REQUEST_ID`` context variable,
which the controller's HTTP middleware sets while it handles a request (tasks created from
there inherit it; other tasks and threads do not). ``RequestIdFilter``, on the one handler,
stamps every record with one or the other, so the formatters only read ``record.request_id``.

Text lines keep the historical shape, with `` [<request_id>]`` after the logger name when the
record has one. JSON lines are one object each: timestamp (ISO 8601, UTC), level, logger,
message, service, request_id (when there is one), exception (the traceback text, when there is
one), and whatever else the caller passed in ``extra``.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import TextIO

from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter as _JsonFormatter

#: The id of the request the current task works for (None outside requests).
REQUEST_ID: ContextVar[str | None] = ContextVar("tandem_request_id", default=None)

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
TEXT_FORMAT_WITH_ID = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
FORMATS = ("text", "json")
# Libraries that install handlers of their own: theirs are dropped so that their records
# propagate to ours (uvicorn must also be started with log_config=None, or it installs its
# handlers again).
THIRD_PARTY_LOGGERS = ("uvicorn", "uvicorn.error", "uvicorn.access", "uvicorn.asgi", "grpc")
# Record attributes that are not the caller's extras: uvicorn's colored duplicate of the
# message, and the fields the JSON formatter writes itself.
_NOT_EXTRA = (*RESERVED_ATTRS, "color_message", "request_id")


@contextlib.contextmanager
def bound_request_id(request_id: str | None) -> Iterator[None]:
    """Within the block (and in tasks created from it), records carry ``request_id``."""
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        REQUEST_ID.reset(token)


class RequestIdFilter(logging.Filter):
    """Sets ``record.request_id``: the one passed in ``extra``, else the context's (or None)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", None):
            record.request_id = REQUEST_ID.get()
        return True


class TextFormatter(logging.Formatter):
    """The historical text line, with `` [<request_id>]`` after the logger name when set."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._with_id = logging.PercentStyle(TEXT_FORMAT_WITH_ID)

    def formatMessage(self, record: logging.LogRecord) -> str:
        if getattr(record, "request_id", None):
            return self._with_id.format(record)
        return super().formatMessage(record)


class JsonFormatter(_JsonFormatter):
    """One JSON object per record (see the module docstring for its fields)."""

    def __init__(self, service: str = "") -> None:
        super().__init__(
            reserved_attrs=_NOT_EXTRA,
            rename_fields={"exc_info": "exception", "stack_info": "stack"},
        )
        self.service = service  # the process kind, in every record

    def add_fields(self, log_data: dict, record: logging.LogRecord, message_dict: dict) -> None:
        when = datetime.fromtimestamp(record.created, tz=UTC)
        log_data["timestamp"] = when.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        log_data["level"] = record.levelname
        log_data["logger"] = record.name
        log_data["message"] = record.message
        log_data["service"] = self.service
        request_id = getattr(record, "request_id", None)
        if request_id:
            log_data["request_id"] = request_id
        # Extras, then the exception and stack text (renamed above).
        super().add_fields(log_data, record, message_dict)


def make_handler(fmt: str = "text", service: str = "", stream: TextIO | None = None):
    """A handler writing ``fmt`` lines ("text" or "json") to ``stream`` (stderr by default),
    with the request id filter."""
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter(service) if fmt == "json" else TextFormatter())
    handler.addFilter(RequestIdFilter())
    return handler


def configure_logging(level: str = "INFO", fmt: str = "text", service: str = "") -> None:
    """Log to stderr at ``level`` in ``fmt`` ("text" or "json"); ``service`` names the process
    kind (controller, executor) in every JSON record. Replaces the root logger's handlers, and
    routes the third-party loggers that have their own (uvicorn, grpc) to it."""
    handler = make_handler(fmt, service)
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in THIRD_PARTY_LOGGERS:
        logger = logging.getLogger(name)
        for old in list(logger.handlers):
            logger.removeHandler(old)
        logger.propagate = True
