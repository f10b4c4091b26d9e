"""The HTTP connection guard in-process: a real uvicorn server on 127.0.0.1 with the guarded
protocol and the body timeout in front of a tiny app, driven with raw sockets: silent, slow and
oversized heads, slow bodies and the connection cap, each closed within its bound, while
ordinary requests, keep-alive and pipelining go on."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import uvicorn

from controller.api.body_timeout import BodyReadTimeout
from controller.api.http_guard import HTTPLimits, HTTPStats, guarded_protocol
from controller.api.http_server import fit_connection_limit
from controller.api.limits import BodySizeLimit
from tests.support.processes import free_port, wait_until

HEAD_TIMEOUT = 1.0
BODY_TIMEOUT = 1.5
MAX_HEAD = 4096
MAX_CONNECTIONS = 8


async def echo_app(scope, receive, send):
    """Answers with the size of the body it read."""
    if scope["type"] != "http":
        return
    size = 0
    while True:
        message = await receive()
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    body = json.dumps({"size": size}).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Served:
    """A uvicorn server on a thread of its own."""

    def __init__(self, limits: HTTPLimits, body_timeout: float = BODY_TIMEOUT):
        self.stats = HTTPStats()
        app = BodyReadTimeout(BodySizeLimit(echo_app, 1 << 20), body_timeout, self.stats)
        self.port = free_port()
        config = uvicorn.Config(
            app,
            host="127.0.0.1",
            port=self.port,
            http=guarded_protocol(limits, self.stats),
            log_level="warning",
            timeout_keep_alive=30,
            lifespan="off",
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve()))
        self.thread.start()
        wait_until(lambda: self.server.started, 10, "uvicorn started")

    def connect(self) -> socket.socket:
        s = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        return s

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)


@pytest.fixture(scope="module")
def served():
    s = Served(HTTPLimits(MAX_CONNECTIONS, MAX_HEAD, HEAD_TIMEOUT))
    yield s
    s.stop()


def read_all(s: socket.socket, timeout: float = 10.0) -> bytes:
    """Everything the server sends until it closes the connection."""
    s.settimeout(timeout)
    out = b""
    while True:
        try:
            chunk = s.recv(65536)
        except ConnectionResetError:
            return out
        if not chunk:
            return out
        out += chunk


def read_response(s: socket.socket) -> bytes:
    """One whole response (head and Content-Length body) from a kept-alive connection."""
    s.settimeout(5)
    out = b""
    while b"\r\n\r\n" not in out:
        out += s.recv(65536)
    head, _, body = out.partition(b"\r\n\r\n")
    length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    while len(body) < length:
        body += s.recv(65536)
    return out


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1]) if response else 0


def request(path: str = "/", body: bytes = b"", extra: str = "") -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
    return head.encode() + body


def get_one(served: Served) -> int:
    with served.connect() as s:
        s.sendall(request(body=b"abc", extra="Connection: close\r\n"))
        return status_of(read_all(s))


def test_a_silent_connection_is_closed_without_an_answer(served):
    before = served.stats.closed["header_timeout"]
    with served.connect() as s:
        started = time.monotonic()
        assert read_all(s) == b""
        assert HEAD_TIMEOUT * 0.8 <= time.monotonic() - started <= HEAD_TIMEOUT + 3
    assert served.stats.closed["header_timeout"] == before + 1


def test_a_head_sent_byte_by_byte_gets_408(served):
    with served.connect() as s:
        started = time.monotonic()
        s.sendall(b"POST / HTTP/1.1\r\nHost: t\r\n")
        s.settimeout(0.2)
        response = b""
        while time.monotonic() - started < HEAD_TIMEOUT + 5:
            try:
                s.sendall(b"X")  # a header name that never ends
                response += s.recv(65536)
                break
            except TimeoutError:
                continue
            except OSError:
                break
        response += read_all(s)
        assert status_of(response) == 408, response
        assert b'"code":"request_timeout"' in response.replace(b" ", b"")
        assert time.monotonic() - started <= HEAD_TIMEOUT + 3


def test_keep_alive_then_a_slow_next_request(served):
    """The keep-alive wait is not the head timer's; the next request's head is."""
    with served.connect() as s:
        s.sendall(request(body=b"ab"))
        assert status_of(read_response(s)) == 200
        time.sleep(HEAD_TIMEOUT * 1.5)  # idle between requests: keep-alive, not closed
        s.sendall(request(body=b"abcd"))
        assert status_of(read_response(s)) == 200
        started = time.monotonic()
        s.sendall(b"\r\n")  # one byte of a next request that never comes
        assert status_of(read_all(s)) in (408, 0)  # closed within the head timeout
        assert time.monotonic() - started <= HEAD_TIMEOUT + 3


def test_oversized_heads_get_431(served):
    before = served.stats.closed["header_too_large"]
    with served.connect() as s:  # an endless header, in many reads
        s.sendall(b"GET / HTTP/1.1\r\nHost: t\r\nX-Pad: ")
        try:
            for _ in range(64):
                s.sendall(b"a" * 1024)
                time.sleep(0.005)
        except OSError:
            pass  # closed while sending: refused
        assert status_of(read_all(s)) in (431, 0)
    with served.connect() as s:  # a complete head over the bound, in one read
        s.sendall(request(extra=f"X-Pad: {'a' * (2 * MAX_HEAD)}\r\n"))
        response = read_all(s)
        assert status_of(response) == 431, response
        assert b"headers_too_large" in response
    assert served.stats.closed["header_too_large"] == before + 2
    with served.connect() as s:  # under the bound: served
        s.sendall(request(body=b"x", extra=f"X-Pad: {'a' * (MAX_HEAD // 2)}\r\n"))
        assert status_of(read_response(s)) == 200


def test_a_slow_body_gets_408(served):
    before = served.stats.closed["body_timeout"]
    with served.connect() as s:
        started = time.monotonic()
        s.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\n0123456789")
        response = read_all(s)
        elapsed = time.monotonic() - started
    assert status_of(response) == 408, response
    assert b"request_timeout" in response and b"connection: close" in response
    assert BODY_TIMEOUT * 0.8 <= elapsed <= BODY_TIMEOUT + 3
    assert served.stats.closed["body_timeout"] == before + 1


def test_ordinary_requests_keep_alive_and_pipelining(served):
    with served.connect() as s:
        body = b"z" * 300_000  # many reads, fast
        s.sendall(request(body=body) + request(body=b"12"))  # two requests, pipelined
        s.sendall(request(body=b"", extra="Connection: close\r\n"))
        response = read_all(s)
    assert response.count(b"HTTP/1.1 200") == 3, response
    assert b'{"size": 300000}' in response and b'{"size": 2}' in response


def test_connections_beyond_the_cap_get_503(served):
    wait_until(lambda: served.stats.open == 0, 10, "no connection open")
    held = [served.connect() for _ in range(MAX_CONNECTIONS)]
    try:
        wait_until(lambda: served.stats.open == MAX_CONNECTIONS, 10, "the cap reached")
        before = served.stats.closed["over_limit"]
        with served.connect() as extra:
            response = read_all(extra)
        assert status_of(response) in (503, 0), response  # 503, or reset before it was read
        assert served.stats.closed["over_limit"] == before + 1
        held.pop().close()
        wait_until(lambda: served.stats.open < MAX_CONNECTIONS, 10, "a connection freed")
        assert get_one(served) == 200  # room again
    finally:
        for s in held:
            s.close()
    wait_until(lambda: served.stats.open == 0, 10, "every connection closed")


def test_no_bounds_when_zero():
    s = Served(HTTPLimits(0, 0, 0.0), body_timeout=0)
    try:
        with s.connect() as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: t\r\nContent-Length: 3\r\n")
            time.sleep(HEAD_TIMEOUT * 1.5)
            sock.sendall(b"X-Pad: " + b"a" * (2 * MAX_HEAD) + b"\r\n\r\nab")
            time.sleep(BODY_TIMEOUT * 1.2)
            sock.sendall(b"c")
            assert status_of(read_response(sock)) == 200
    finally:
        s.stop()


def test_fit_connection_limit_keeps_room_for_descriptors():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert fit_connection_limit(0) == 0
    assert fit_connection_limit(10) == 10
    assert fit_connection_limit(soft * 2, reserve=100) == soft - 100
