"""A client that stops reading its stream (a raw socket on 127.0.0.1 that never reads): once
the socket's buffers are full, the controller waits --stream-stall-timeout for it, then
aborts the response; its sequences end, their KV blocks are freed while the socket is still
open, the controller's memory stays bounded, and other clients are served as before.

Before (main at 3aa6b4e): the stalled response generated on for as long as its socket stayed
open (KV blocks held: 32 more every 3 s, 288 after 30 s), and was aborted only when the
client finally closed it.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from tests.e2e.adversarial.bounds_support import innocent
from tests.e2e.helpers import assert_no_blocks_in_use, executors_lost, metric_sum, metrics_text
from tests.support.processes import rss_mib, start_server

STALL_TIMEOUT = 2.0  # seconds, the server's --stream-stall-timeout
N, MAX_TOKENS = 16, 1500  # 16 streams of top-20 logprobs fill the socket's buffers fast
DEADLINE = 240.0  # seconds for buffers to fill (a few MB) plus the timeout, on a loaded machine
RSS_BOUND_MIB = 100  # controller memory growth while the stalled response lives


@pytest.fixture(scope="module")
def stall_server(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("stall")),
        controller_args=["--stream-stall-timeout", str(STALL_TIMEOUT)],
    )
    yield s
    s.stop()


def _stalled_stream(server) -> socket.socket:
    """Open a stream and never read it (a small receive buffer, so it fills sooner)."""
    body = json.dumps(
        {
            "prompt": "Once upon a time",
            "n": N,
            "max_tokens": MAX_TOKENS,
            "logprobs": 20,
            "ignore_eos": True,
            "stream": True,
        }
    ).encode()
    port = int(server.base_url.rsplit(":", 1)[1])
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    sock.sendall(head.encode() + body)
    return sock


def _aborted(server) -> float:
    """Sequences that ended with finish_reason "abort"."""
    lines = metrics_text(server).splitlines()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in lines
        if line.startswith("vllm:request_success_total{") and 'finished_reason="abort"' in line
    )


def _used_blocks(server) -> int:
    return sum(e["used_blocks"] for e in server.executors_state())


def test_stalled_reader_is_aborted_and_its_blocks_freed(stall_server):
    s = stall_server
    reference = innocent(s)
    rss, losses, aborted = rss_mib(s.controller.pid), executors_lost(s), _aborted(s)
    sock = _stalled_stream(s)
    try:
        started, peak, seen_blocks = time.monotonic(), rss, 0
        while True:
            time.sleep(0.5)
            peak = max(peak, rss_mib(s.controller.pid))
            used = _used_blocks(s)
            seen_blocks = max(seen_blocks, used)
            if seen_blocks and used == 0:
                break
            assert time.monotonic() - started < DEADLINE, f"still {used} blocks in use"
        elapsed = time.monotonic() - started
        # Freed while the client still holds its socket open: the stall aborted it.
        assert _aborted(s) - aborted == N
        generated = metric_sum(metrics_text(s), "vllm:generation_tokens_total")
        assert generated < N * MAX_TOKENS
        assert innocent(s) == reference  # others are served as before
        state = httpx.get(s.base_url + "/admin/executors", timeout=10).json()["admission"]
        assert state["active_responses"] == 0 and state["queued_requests"] == 0, state
    finally:
        sock.close()
    assert peak - rss < RSS_BOUND_MIB, (rss, peak)
    assert executors_lost(s) == losses
    assert_no_blocks_in_use(s)
    with open(f"{s.log_dir}/controller.log") as f:
        assert "read nothing for 2s" in f.read()
    print(f"stalled reader aborted after {elapsed:.1f}s, RSS {rss:.0f} -> {peak:.0f} MiB")


def test_a_slow_reader_is_not_aborted(stall_server):
    """A client that reads, slowly, gets its whole stream: only a write that waits past the
    timeout aborts."""
    s = stall_server
    body = {"prompt": "Count:", "max_tokens": 24, "temperature": 0, "stream": True}
    events: list[str] = []
    with httpx.stream("POST", s.base_url + "/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data:"):
                events.append(line)
                time.sleep(0.1)
    assert events[-1] == "data: [DONE]" and len(events) > 2
