"""haproxy in front of several controllers (tandem/haproxy_config.py, tandem/balancer.py): the
generated config says what the docs promise and haproxy accepts it; a live haproxy in front of
two small HTTP servers retries a POST that one of them refuses (503) or drops (no answer) on
the other, reports each server's state, and names the server that answered."""

from __future__ import annotations

import http.server
import threading

import httpx
import pytest

from tandem import balancer
from tandem.haproxy_config import Backend, BalancerOptions, render
from tests.support.balancer import require_haproxy, start_balancer
from tests.support.processes import free_port, wait_until


def options(**kw) -> BalancerOptions:
    backends = [Backend("c0", "127.0.0.1:1"), Backend("c1", "127.0.0.1:2")]
    return BalancerOptions("127.0.0.1:8000", backends, "/tmp/x.sock", **kw)


def test_the_config_says_what_the_docs_promise():
    text = render(options())
    for line in (
        "bind 127.0.0.1:8000",
        "balance leastconn",
        "option httpchk GET /health",
        "http-check expect status 200",
        "retry-on conn-failure empty-response 503",
        "option redispatch 1",
        "option http-buffer-request",
        "tune.bufsize 65536",
        "timeout server 3600s",
        "server c0 127.0.0.1:1 check inter 1000ms fall 2 rise 1 observe layer4",
        "server c1 127.0.0.1:2 check inter 1000ms fall 2 rise 1 observe layer4",
        "stats socket /tmp/x.sock",
    ):
        assert line in text, line
    assert "daemon" not in text  # the launcher supervises it in the foreground


def test_haproxy_accepts_the_config_and_refuses_a_broken_one(tmp_path):
    require_haproxy()
    path = balancer.write_config(str(tmp_path), options())
    assert balancer.command(path)[1:] == ["-db", "-f", path]
    with pytest.raises(RuntimeError, match="haproxy refused"):
        balancer.write_config(str(tmp_path), options(extra_global=["no-such-keyword 1"]))


class Answers(http.server.BaseHTTPRequestHandler):
    """GET /health: 200; POST: the server's `mode` (ok: 200 with the body's length, refuse:
    503, drop: the connection closed with no answer)."""

    protocol_version = "HTTP/1.1"
    mode = "ok"

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        self._answer(200, b"ok")

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.mode == "drop":
            self.close_connection = True
            return
        self._answer(503 if self.mode == "refuse" else 200, str(len(body)).encode())

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class QuietServer(http.server.ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        pass  # haproxy resets its health checks' connections: nothing to report


def serve(mode: str) -> http.server.ThreadingHTTPServer:
    handler = type(f"Answers_{mode}", (Answers,), {"mode": mode})
    server = QuietServer(("127.0.0.1", free_port()), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("mode", ["refuse", "drop"])
def test_a_refused_or_dropped_post_is_replayed_on_the_other_server(tmp_path, mode):
    bad, good = serve(mode), serve("ok")
    servers = {"bad": f"127.0.0.1:{bad.server_port}", "good": f"127.0.0.1:{good.server_port}"}
    live = start_balancer(str(tmp_path), servers)
    try:
        wait_until(lambda: live.states() == {"bad": "UP", "good": "UP"}, 30, "both UP")
        body = b"x" * 50_000  # fits the buffer: replayable
        for _ in range(10):
            resp = httpx.post(live.base_url + "/v1/completions", content=body, timeout=30)
            assert resp.status_code == 200 and resp.text == "50000"
            assert resp.headers["x-tandem-controller"] == "good"
        backend = [r for r in live.stats() if r["svname"] == "BACKEND"]
        assert int(backend[0]["wretr"]) + int(backend[0]["wredis"]) >= 1  # replayed
        good.shutdown()
        good.server_close()  # gone: haproxy marks it DOWN within fall x inter
        wait_until(lambda: live.states()["good"] == "DOWN", 10, "good DOWN")
    finally:
        live.stop()
        bad.shutdown()


def test_with_no_controller_up_haproxy_answers_an_openai_error(tmp_path):
    live = start_balancer(str(tmp_path), {"nobody": f"127.0.0.1:{free_port()}"})
    try:
        wait_until(lambda: live.states() == {"nobody": "DOWN"}, 10, "DOWN")
        resp = httpx.post(live.base_url + "/v1/completions", json={}, timeout=10)
        assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
        assert resp.json()["error"]["code"] == "unavailable"
        assert resp.json()["error"]["type"] == "server_error"
    finally:
        live.stop()
