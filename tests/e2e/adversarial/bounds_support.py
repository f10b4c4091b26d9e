"""What the hostile-body tests share: the cost of one request to the controller (seconds to
answer, resident memory growth, executor losses) measured while an innocent greedy request
runs alongside, whose answer must not change."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from tests.e2e.helpers import executors_lost
from tests.support.processes import LiveServer, rss_mib

REFERENCE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}


@dataclass
class Cost:
    """What one hostile request cost the controller."""

    seconds: float  # until its answer arrived
    rss_growth_mib: float  # controller resident memory after, minus before
    executor_losses: float  # tandem:executor_lost_total after, minus before
    innocent_text: str  # the concurrent greedy request's answer


def innocent(server: LiveServer) -> str:
    """The greedy reference completion's text."""
    r = httpx.post(server.base_url + "/v1/completions", json=REFERENCE, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def measure(server: LiveServer, send: Callable[[], httpx.Response]) -> tuple[httpx.Response, Cost]:
    """Send a hostile request while an innocent one runs; what it answered and cost."""
    pid = server.controller.pid
    losses, rss = executors_lost(server), rss_mib(pid)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(innocent, server)
        started = time.perf_counter()
        response = send()
        seconds = time.perf_counter() - started
        text = other.result(timeout=180)
    cost = Cost(seconds, rss_mib(pid) - rss, executors_lost(server) - losses, text)
    print(f"cost: {cost}")
    return response, cost


def post(server: LiveServer, path: str, body: dict | bytes, timeout: float = 120):
    """A sender for `measure`: POST a JSON body (or raw JSON bytes)."""

    def send() -> httpx.Response:
        if isinstance(body, bytes):
            headers = {"content-type": "application/json"}
            return httpx.post(
                server.base_url + path, content=body, headers=headers, timeout=timeout
            )
        return httpx.post(server.base_url + path, json=body, timeout=timeout)

    return send


def raw_exchanges(server: LiveServer, bodies: list[bytes], path: str) -> list[int]:
    """POST each raw JSON body in turn on ONE keep-alive connection; the status codes (the
    connection closing early shows as fewer codes)."""
    port = int(server.base_url.rsplit(":", 1)[1])
    codes = []
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        reader = sock.makefile("rb")
        for body in bodies:
            head = (
                f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\n\r\n"
            )
            try:
                sock.sendall(head.encode() + body)
                status = reader.readline()
                if not status:
                    break
                length = 0
                while (line := reader.readline()) not in (b"\r\n", b""):
                    name, _, value = line.decode("latin-1").partition(":")
                    if name.lower() == "content-length":
                        length = int(value)
                reader.read(length)
                codes.append(int(status.split()[1]))
            except OSError:
                break
    return codes
