"""The connection of a stream a writer owns (--stream-writers 1, simulated executor): a client
that half-closes (or closes) while tokens are still coming is noticed at once, its request
aborted and its KV blocks freed; requests pipelined behind a written stream on one keep-alive
connection are answered in order after it."""

from __future__ import annotations

import json
import socket
import time

from tests.e2e import test_stream_writers as base
from tests.e2e.helpers import assert_no_blocks_in_use
from tests.e2e.test_stream_writers import PROMPT, _events, _read_response, _streams
from tests.support.processes import wait_until

writer_server = base.writer_server  # the same server's setup (started for this module)

SLOW = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}


def _request(port: int, body: dict) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    return head.encode() + data


def _port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def test_a_half_closed_client_is_noticed_and_its_blocks_freed(writer_server):
    s = writer_server
    gone = _streams(s, "client_gone")
    with socket.create_connection(("127.0.0.1", _port(s)), timeout=60) as sock:
        sock.sendall(_request(_port(s), SLOW))
        got = b""
        while got.count(b"data: {") < 5:
            got += sock.recv(65536)
        assert sum(e["used_blocks"] for e in s.executors_state()) > 0
        start = time.monotonic()
        sock.shutdown(socket.SHUT_WR)  # done sending; still reading (a half-close)
        wait_until(lambda: _streams(s, "client_gone") == gone + 1, 30, "the hangup noticed")
        # Far below the stall timeout (10 s): the hangup, not a stalled write, ended it.
        assert time.monotonic() - start < 8
        assert_no_blocks_in_use(s)
        sock.settimeout(30)
        while sock.recv(65536):  # the controller closes the connection
            pass


def test_pipelined_requests_behind_a_written_stream(writer_server):
    """Three requests sent at once on one connection (a stream, a whole response, a stream):
    each answered in order, complete, and the connection kept alive after them."""
    s = writer_server
    port = _port(s)
    streamed = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}
    whole = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0}
    written = _streams(s, "finished")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(_request(port, streamed) + _request(port, whole) + _request(port, streamed))
        first = _read_response(sock)
        raw = b""
        while b"\r\n\r\n" not in raw:
            raw += sock.recv(65536)
        head, rest = raw.split(b"\r\n\r\n", 1)
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        while len(rest) < length:
            rest += sock.recv(65536)
        second, tail = rest[:length], rest[length:]
        third = tail + _read_response_after(sock, tail)
        sock.sendall(_request(port, streamed))  # still alive
        fourth = _read_response(sock)
    texts = []
    for body in (first, third, fourth):
        assert body.split(b"\r\n", 1)[0] == b"HTTP/1.1 200 OK", body[:200]
        events = _events(body.split(b"\r\n\r\n", 1)[1])
        texts.append("".join(json.loads(e[6:])["choices"][0]["text"] for e in events))
        assert b"data: [DONE]\n\n" in body
    assert texts[0] == texts[1] == texts[2] == json.loads(second)["choices"][0]["text"]
    assert _streams(s, "finished") >= written + 2  # the streams were the writer's
    assert_no_blocks_in_use(s)


def _read_response_after(sock: socket.socket, got: bytes) -> bytes:
    """The rest of a chunked response of which `got` was read already."""
    out = b""
    while not (got + out).endswith(b"\r\n0\r\n\r\n"):
        data = sock.recv(65536)
        assert data, f"the connection closed after {(got + out)[-200:]!r}"
        out += data
    return out
