"""Streamed responses written by a stream writer process (--stream-writers 1), with a
simulated executor: the openai client reads the same chunks as from the in-process path (a
second server without writers, its own simulated executor: greedy tokens are a function of the
prompt and position), usage chunk included; the connection is kept alive and serves the next
request, and a client that leaves mid-stream has its request aborted and its KV blocks
freed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess

import pytest

from tests.e2e.adversarial.isolation_support import SIM_SPEED
from tests.e2e.helpers import PROMPTS, assert_no_blocks_in_use, metric_sum, metrics_text
from tests.e2e.test_shutdown import _finish, _stream
from tests.support.processes import start_server, wait_until

PROMPT = [10, 200, 3000, 40, 5]
FAULT_TOKEN = 49000  # a prompt with it fails alone on the simulated executors
FAULT = ["--fault", "reject", "--fault-token-id", str(FAULT_TOKEN)]


@pytest.fixture(scope="module")
def writer_server(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("writers")),
        controller_args=["--stream-writers", "1", "--stream-stall-timeout", "10"],
        executor_args=[*SIM_SPEED, *FAULT],
        executor_kinds=("executor_sim",),
    )
    yield s
    s.stop()


@pytest.fixture(scope="module")
def plain_server(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("plain")),
        executor_args=[*SIM_SPEED, *FAULT],
        executor_kinds=("executor_sim",),
    )
    yield s
    s.stop()


def _writers(server) -> list[str]:
    """The controller's stream writer processes (their command lines)."""
    out = subprocess.run(
        ["ps", "-o", "args=", "--ppid", str(server.controller.pid)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [line for line in out.splitlines() if "controller.api.writers.worker" in line]


def _chunks(client, model: str, **kw) -> list[dict]:
    kw = {"max_tokens": 40, **kw}
    stream = client.completions.create(model=model, prompt=PROMPT, temperature=0, stream=True, **kw)
    return [c.model_dump(exclude={"id", "created"}) for c in stream]


def _chat(client, model: str, **kw) -> list[dict]:
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=20,
        temperature=0,
        stream=True,
        **kw,
    )
    return [c.model_dump(exclude={"id", "created"}) for c in stream]


@pytest.mark.parametrize("usage", [False, True])
def test_chunks_equal_the_in_process_path(writer_server, plain_server, usage):
    s, plain = writer_server, plain_server
    kw = {"stream_options": {"include_usage": True}} if usage else {}
    written = _streams(s, "finished")
    via_writer = _chunks(s.client(), s.model_name, **kw)
    assert _streams(s, "finished") == written + 1, "the stream was not a writer's"
    assert via_writer == _chunks(plain.client(), plain.model_name, **kw)
    last = via_writer[-2 if usage else -1]
    assert last["choices"][0]["finish_reason"] == "length"
    if usage:
        assert via_writer[-1]["choices"] == []
    chat = _chat(s.client(), s.model_name, **kw)
    assert chat == _chat(plain.client(), plain.model_name, **kw)
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    assert_no_blocks_in_use(s)


def _raw_request(sock: socket.socket, port: int, body: dict) -> None:
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)


def _read_response(sock: socket.socket) -> bytes:
    """One chunked response, through its terminating zero-length chunk."""
    out = b""
    while not out.endswith(b"\r\n0\r\n\r\n"):
        data = sock.recv(65536)
        assert data, f"the connection closed after {out[-200:]!r}"
        out += data
    return out


def test_keep_alive_after_a_written_stream(writer_server):
    s = writer_server
    port = int(s.base_url.rsplit(":", 1)[1])
    body = {"prompt": PROMPT, "max_tokens": 30, "temperature": 0, "stream": True}
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        _raw_request(sock, port, body)
        first = _read_response(sock)
        assert b"transfer-encoding: chunked" in first.lower()
        assert b"data: [DONE]\n\n" in first
        _raw_request(sock, port, body)  # the same connection, kept alive
        second = _read_response(sock)
        assert b"data: [DONE]\n\n" in second
        strip = [part.split(b"\r\n\r\n", 1)[1] for part in (first, second)]
        texts = [
            [json.loads(line[6:])["choices"][0]["text"] for line in _events(body)] for body in strip
        ]
        assert texts[0] == texts[1]
    assert_no_blocks_in_use(s)


def _events(body: bytes) -> list[bytes]:
    """The SSE data lines of a chunked body, less [DONE]."""
    lines = [line for line in body.split(b"\n") if line.startswith(b"data: {")]
    return lines


def test_a_client_that_leaves_mid_stream_frees_its_blocks(writer_server):
    s = writer_server
    port = int(s.base_url.rsplit(":", 1)[1])
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    gone = _streams(s, "client_gone")
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        _raw_request(sock, port, body)
        got = b""
        while got.count(b"data: {") < 5:
            got += sock.recv(65536)
        used = sum(e["used_blocks"] for e in s.executors_state())
        assert used > 0
    assert_no_blocks_in_use(s)
    assert _streams(s, "client_gone") == gone + 1
    client = s.client()
    assert _chunks(client, s.model_name)  # the writer serves on


def _streams(server, reason: str) -> float:
    """Streams the writers ended with this reason (tandem:stream_writer_streams_total)."""
    name = f'tandem:stream_writer_streams_total{{reason="{reason}"}}'
    return metric_sum(metrics_text(server), name)


def test_a_failed_sequence_gives_the_in_process_error_event(writer_server, plain_server):
    s, plain = writer_server, plain_server
    body = {"prompt": [*PROMPT, FAULT_TOKEN], "max_tokens": 20, "temperature": 0, "stream": True}
    written, bodies = _streams(s, "finished"), []
    for server in (s, plain):
        port = int(server.base_url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
            _raw_request(sock, port, body)
            raw = _read_response(sock).split(b"\r\n\r\n", 1)[1]
        bodies.append([line for line in raw.split(b"\n") if line.startswith(b"data: ")])
    assert bodies[0] == bodies[1]
    assert b'"error"' in bodies[0][0] and bodies[0][-1] == b"data: [DONE]"
    assert _streams(s, "finished") == written + 1  # the writer wrote it
    assert_no_blocks_in_use(s)


def _finished(server, reason: str) -> float:
    """Requests that ended with this finish reason (vllm:request_success_total)."""
    label = f'finished_reason="{reason}"'
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics_text(server).splitlines()
        if line.startswith("vllm:request_success_total{") and label in line
    )


def test_a_stop_string_found_by_the_writer(writer_server, plain_server):
    """The writer ends the stream at the stop string as the in-process path does, and the
    request ends there as "stop", its blocks freed."""
    s, plain = writer_server, plain_server
    whole = plain.client().completions.create(
        model=plain.model_name, prompt=PROMPT, max_tokens=60, temperature=0
    )
    text = whole.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    kw = {"stop": [stop], "max_tokens": 200}
    stops, written = _finished(s, "stop"), _streams(s, "finished")
    via_writer = _chunks(s.client(), s.model_name, **kw)
    assert via_writer == _chunks(plain.client(), plain.model_name, **kw)
    assert via_writer[-1]["choices"][0]["finish_reason"] == "stop"
    assert_no_blocks_in_use(s)
    assert _finished(s, "stop") == stops + 1
    assert _streams(s, "finished") == written + 1


def _writer_pids(server) -> list[int]:
    out = subprocess.run(
        ["ps", "-o", "pid=,args=", "--ppid", str(server.controller.pid)],
        capture_output=True,
        text=True,
        check=False,
    ).stdout
    return [int(line.split()[0]) for line in out.splitlines() if "writers.worker" in line]


def test_a_writer_that_dies_ends_its_streams_and_is_restarted(writer_server):
    s = writer_server
    port = int(s.base_url.rsplit(":", 1)[1])
    _chunks(s.client(), s.model_name)  # the writer runs
    (pid,) = _writer_pids(s)
    body = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        _raw_request(sock, port, body)
        got = b""
        while got.count(b"data: {") < 5:
            got += sock.recv(65536)
        errors = _streams(s, "error")
        os.kill(pid, signal.SIGKILL)
        while data := sock.recv(65536):  # the connection is closed, the response unfinished
            got += data
        assert not got.endswith(b"\r\n0\r\n\r\n")
    assert _streams(s, "error") == errors + 1
    assert_no_blocks_in_use(s)
    wait_until(lambda: _writer_pids(s) not in ([], [pid]), 30, "a new stream writer")
    assert _chunks(s.client(), s.model_name)[-1]["choices"][0]["finish_reason"] == "length"
    assert_no_blocks_in_use(s)


def test_sigterm_ends_writer_streams_as_aborted(default_model_dir, tmp_path):
    """SIGTERM past the grace period: a stream a writer owns ends as the in-process path ends
    it (finish_reason "abort", then [DONE]), and the controller exits cleanly."""
    s = start_server(
        default_model_dir,
        str(tmp_path),
        controller_args=["--stream-writers", "1", "--shutdown-grace", "1"],
        executor_args=["--step-fixed-ms", "20"],
        executor_kinds=("executor_sim",),
    )
    try:
        body = {"model": s.model_name, "max_tokens": 2000, "ignore_eos": True, "stream": True}

        async def run():
            events: list[list[dict]] = [[], []]
            tasks = [
                asyncio.create_task(_stream(s.base_url, {**body, "prompt": p}, ev))
                for p, ev in zip(PROMPTS, events)
            ]
            while not all(events):
                await asyncio.sleep(0.05)
            gauge = "tandem:stream_writer_streams_open"
            assert metric_sum(metrics_text(s), gauge) == 2  # both are the writer's
            s.controller.send_signal(signal.SIGTERM)
            await asyncio.gather(*tasks)
            return events

        for events in asyncio.run(run()):
            assert _finish(events) == "abort", events[-3:]
            assert events[-1] == {"done": True}
        assert s.controller.wait(timeout=30) == 0
    finally:
        s.stop()


def test_a_stalled_client_is_cut_and_its_blocks_freed(writer_server):
    """A client that stops reading a writer's stream: past --stream-stall-timeout (10 s here)
    the writer ends it, the requests are aborted and their blocks freed while the client's
    socket is still open."""
    s = writer_server
    port = int(s.base_url.rsplit(":", 1)[1])
    body = {"prompt": PROMPT, "n": 16, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    stalled = _streams(s, "stalled")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    try:
        _raw_request(sock, port, body)  # and never read
        wait_until(lambda: _streams(s, "stalled") == stalled + 1, 120, "the stall cut")
        assert_no_blocks_in_use(s)
    finally:
        sock.close()
