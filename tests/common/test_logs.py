"""common.logs: text and JSON lines, request ids from the context or from `extra`."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import re
import threading

import pytest

from common import logs


@pytest.fixture
def capture():
    """A function (fmt, service) -> (logger, buffer): records of a fresh logger go through
    a handler of common.logs into the buffer."""
    loggers = []

    def make(fmt: str = "text", service: str = "svc") -> tuple[logging.Logger, io.StringIO]:
        buf = io.StringIO()
        logger = logging.getLogger(f"tests.logs.{len(loggers)}")
        logger.handlers = [logs.make_handler(fmt, service, buf)]
        logger.propagate = False
        logger.setLevel(logging.DEBUG)
        loggers.append(logger)
        return logger, buf

    yield make
    for logger in loggers:
        logger.handlers = []
        logger.propagate = True


def _json_lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


TEXT_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (\w+) ([\w.]+)( \[(.+)\])?: (.*)")


def test_text_line_without_and_with_a_request_id(capture):
    log, buf = capture("text")
    log.info("plain %d", 1)
    log.warning("explicit", extra={"request_id": "req-1"})
    with logs.bound_request_id("ctx-2"):
        log.info("from the context")
        log.info("extra wins", extra={"request_id": "req-3"})
    log.info("after the block")
    lines = buf.getvalue().splitlines()
    parsed = [TEXT_LINE.fullmatch(line) for line in lines]
    assert all(parsed), lines
    assert [(m[1], m[4], m[5]) for m in parsed] == [
        ("INFO", None, "plain 1"),
        ("WARNING", "req-1", "explicit"),
        ("INFO", "ctx-2", "from the context"),
        ("INFO", "req-3", "extra wins"),
        ("INFO", None, "after the block"),
    ]
    assert parsed[0][2] == log.name


def test_text_exception_follows_the_line(capture):
    log, buf = capture("text")
    try:
        raise ValueError("bad thing")
    except ValueError:
        log.exception("it failed", extra={"request_id": "r9"})
    first, *rest = buf.getvalue().splitlines()
    assert first.endswith(f"ERROR {log.name} [r9]: it failed")
    assert rest[0] == "Traceback (most recent call last):"
    assert rest[-1] == "ValueError: bad thing"


def test_json_fields(capture):
    log, buf = capture("json", service="executor")
    log.info("hello %s", "world")
    with logs.bound_request_id("abc"):
        log.debug("in a request", extra={"step": 7})
    plain, in_request = _json_lines(buf)
    assert list(plain) == ["timestamp", "level", "logger", "message", "service"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", plain["timestamp"])
    assert plain["level"] == "INFO" and plain["logger"] == log.name
    assert plain["message"] == "hello world" and plain["service"] == "executor"
    assert in_request["request_id"] == "abc" and in_request["level"] == "DEBUG"
    assert in_request["step"] == 7


def test_json_exception_and_odd_values(capture):
    log, buf = capture("json")
    try:
        raise KeyError("missing")
    except KeyError:
        log.exception("lookup of %s failed", "k\udcff", extra={"request_id": "r1"})
    log.info("object extra", extra={"thing": object()})
    failed, odd = _json_lines(buf)
    assert failed["request_id"] == "r1" and failed["level"] == "ERROR"
    assert failed["exception"].startswith("Traceback (most recent call last):")
    assert failed["exception"].endswith("KeyError: 'missing'")
    assert "k\udcff" in failed["message"]
    assert odd["thing"].startswith("<object")
    assert "exception" not in odd and "request_id" not in odd


def test_thread_and_other_task_have_no_id(capture):
    log, buf = capture("json")

    async def main():
        other_ready = asyncio.Event()
        go = asyncio.Event()

        async def other():  # created outside any request
            other_ready.set()
            await go.wait()
            log.info("other task")

        async def request():
            with logs.bound_request_id("req-a"):
                await asyncio.create_task(child())  # inherits the id
                go.set()
                thread = threading.Thread(target=lambda: log.info("thread"))
                thread.start()
                thread.join()
                await asyncio.sleep(0)

        async def child():
            log.info("child task")

        task = asyncio.create_task(other())
        await other_ready.wait()
        await request()
        await task

    asyncio.run(main())
    ids = {r["message"]: r.get("request_id") for r in _json_lines(buf)}
    assert ids == {"child task": "req-a", "thread": None, "other task": None}


def test_configure_logging_routes_third_party_loggers():
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    uvicorn = logging.getLogger("uvicorn.access")
    own = logging.StreamHandler(io.StringIO())
    uvicorn.addHandler(own)
    uvicorn.propagate = False
    try:
        logs.configure_logging("debug", "json", "controller")
        assert root.level == logging.DEBUG
        (handler,) = root.handlers
        assert isinstance(handler.formatter, logs.JsonFormatter)
        assert uvicorn.handlers == [] and uvicorn.propagate
        with pytest.raises(ValueError):
            logs.make_handler("xml")
    finally:
        root.handlers = saved[0]
        root.setLevel(saved[1])
