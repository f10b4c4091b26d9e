"""Executors failing mid-generation lose no request: streams pause, then continue exactly.

- The only executor killed and restarted: its requests wait for it, then resume there.
- One of two executors killed with SIGKILL, or hung with SIGSTOP: its requests move to the
  other executor and resume by recompute; the killed one is restarted, the hung one continues,
  and each takes work again.
- The only executor gone for good: requests wait for the configured time, then fail (503).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import jsonschema
import pytest

from tests.e2e.helpers import (
    MAX_TOKENS,
    PROMPTS,
    assert_no_blocks_in_use,
    expected_texts,
    metric_sum,
    stream_completion,
)
from tests.support.processes import (
    FAST_HEALTH,
    ROOT,
    executor_command,
    start_server,
    wait_healthy_executors,
)

STREAM_PROMPTS = [f"{p} (story {i})" for i, p in enumerate(PROMPTS * 3)]  # 12 streams


def _pause_after(chunks: list[float], t: float) -> float:
    """Longest wait for a chunk from time t on (the stream's pause around the failure)."""
    times = [t] + [c for c in chunks if c > t]
    return max(b - a for a, b in zip(times, times[1:])) if len(times) > 1 else 0.0


@pytest.mark.slow
def test_killed_executor_is_recovered_and_streams_continue(default_model_dir, tmp_path):
    """The only executor dies: requests wait for it and resume when it is back."""
    server = start_server(default_model_dir, str(tmp_path), controller_args=FAST_HEALTH)
    try:
        expected = expected_texts(server, PROMPTS, 48)
        port = server.executor_ports[0]

        async def run():
            started = asyncio.Event()
            tasks = [
                asyncio.create_task(stream_completion(server, p, [], started, 48)) for p in PROMPTS
            ]
            await asyncio.wait_for(started.wait(), timeout=120)
            victim = server.executors[0]
            victim.send_signal(signal.SIGKILL)
            victim.wait()
            log = open(os.path.join(str(tmp_path), "executor0-restarted.log"), "w")
            server.executors[0] = subprocess.Popen(
                [sys.executable, *executor_command("executor_gpu", default_model_dir, port)],
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            return await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)

        texts = asyncio.run(run())
        assert texts == expected, (texts, expected)
        assert_no_blocks_in_use(server)
        metrics = httpx.get(server.base_url + "/metrics").text
        assert metric_sum(metrics, "tandem:executor_lost_total") >= 1
        assert metric_sum(metrics, "tandem:executor_reconnects_total") >= 1
        (state,) = server.executors_state()
        assert state["healthy"] and state["incarnations"] == 2
    finally:
        server.stop()


def _fail_one_mid_stream(
    server, sig: signal.Signals, extra: dict | None = None, max_tokens: int = MAX_TOKENS
):
    """Start the streams (`extra`: more body fields), then send `sig` to the executor holding
    most of them. Returns (texts, expected, victim index, seconds from the signal to the
    victim marked lost, longest stream pause after the signal, the victim's state before)."""
    expected = expected_texts(server, STREAM_PROMPTS, max_tokens, extra)

    async def run():
        started = asyncio.Event()
        chunks = [[] for _ in STREAM_PROMPTS]
        tasks = [
            asyncio.create_task(stream_completion(server, p, c, started, max_tokens, extra))
            for p, c in zip(STREAM_PROMPTS, chunks)
        ]
        await asyncio.wait_for(started.wait(), timeout=120)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
            state = (await http.get("/admin/executors")).json()["executors"]
            victim = max(state, key=lambda e: e["requests"])
            assert victim["requests"] > 0, state
            index = server.executor_ports.index(int(victim["address"].rsplit(":", 1)[1]))
            t_signal = time.perf_counter()
            os.kill(server.executors[index].pid, sig)
            detected = None
            while detected is None:
                now = (await http.get("/admin/executors")).json()["executors"]
                if not next(e for e in now if e["address"] == victim["address"])["healthy"]:
                    detected = time.perf_counter() - t_signal
                else:
                    await asyncio.sleep(0.05)
        texts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
        pause = max(_pause_after(c, t_signal) for c in chunks)
        return texts, index, detected, pause, victim

    texts, index, detected, pause, victim = asyncio.run(run())
    return texts, expected, index, detected, pause, victim


@pytest.mark.slow
def test_kill9_one_of_two_executors_mid_stream(executor_pair, default_model_dir):
    server = executor_pair
    wait_healthy_executors(server, 2)
    texts, expected, index, detected, pause, victim = _fail_one_mid_stream(server, signal.SIGKILL)
    print(
        f"\nFLEET kill -9: {victim['requests']} requests on the victim, detected "
        f"{detected:.2f}s, longest stream pause {pause:.2f}s"
    )
    assert texts == expected
    assert victim["step_transport"] == "socket"  # the pair's steps go over step sockets
    # Every block on the survivor is back; the victim holds nothing.
    assert_no_blocks_in_use(server)
    metrics = httpx.get(server.base_url + "/metrics").text
    assert metric_sum(metrics, "tandem:requests_failed_over_total") >= victim["requests"]
    # Restart the killed executor on its port: a new incarnation joins and takes work again.
    state = _restart(server, index, default_model_dir)
    back = next(e for e in state if e["address"] == victim["address"])
    assert back["incarnation"] != victim["incarnation"] and back["reconnects"] >= 1
    placed_before = back["requests_placed"]
    again = expected_texts(server, STREAM_PROMPTS[:6])
    assert again == expected[:6]
    back = next(e for e in server.executors_state() if e["address"] == victim["address"])
    assert back["requests_placed"] > placed_before, back
    assert back["step_transport"] == "socket", back  # the restarted one's socket too
    assert_no_blocks_in_use(server)


def _restart(server, index: int, model_dir) -> list[dict]:
    """Start the killed executor `index` again on its port; the fleet's state once both are
    healthy."""
    server.executors[index].wait()
    port = server.executor_ports[index]
    step = server.executor_step_ports[index:]
    extra = ["--step-port", str(step[0])] if step else []
    log = open(os.path.join(server.log_dir, f"executor{index}-restarted.log"), "w")
    server.executors[index] = subprocess.Popen(
        [sys.executable, *executor_command("executor_gpu", model_dir, port, extra)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return wait_healthy_executors(server, 2)


# Long constrained outputs: 24 short strings, ~100 tokens of JSON.
LIST_SCHEMA = {
    "type": "object",
    "properties": {
        "words": {
            "type": "array",
            "items": {"type": "string", "maxLength": 8},
            "minItems": 24,
            "maxItems": 24,
        }
    },
    "required": ["words"],
    "additionalProperties": False,
}


@pytest.mark.slow
def test_constrained_requests_survive_kill9_of_their_executor(executor_pair, default_model_dir):
    """JSON-schema requests moved mid-output to the other executor continue under the same
    grammar (replayed over their output so far): every text validates and equals the run
    without a failure."""
    server = executor_pair
    wait_healthy_executors(server, 2)
    extra = {"structured_outputs": {"json": LIST_SCHEMA}}
    texts, expected, index, _, _, victim = _fail_one_mid_stream(
        server, signal.SIGKILL, extra, max_tokens=400
    )
    assert victim["requests"] > 0
    assert texts == expected
    for text in texts:
        jsonschema.validate(json.loads(text), LIST_SCHEMA)
    assert_no_blocks_in_use(server)
    _restart(server, index, default_model_dir)


@pytest.mark.slow
def test_hung_executor_is_detected_by_timeout(executor_pair):
    server = executor_pair
    wait_healthy_executors(server, 2)
    texts, expected, index, detected, pause, victim = _fail_one_mid_stream(server, signal.SIGSTOP)
    print(
        f"\nFLEET SIGSTOP: {victim['requests']} requests on the victim, detected "
        f"{detected:.2f}s, longest stream pause {pause:.2f}s"
    )
    try:
        assert texts == expected
        assert victim["step_transport"] == "socket"
        assert detected < 15, detected
        assert_no_blocks_in_use(server)
    finally:
        os.kill(server.executors[index].pid, signal.SIGCONT)
    # The same process answers again: the controller reconnects (same incarnation) and the
    # executor takes work again.
    state = wait_healthy_executors(server, 2)
    back = next(e for e in state if e["address"] == victim["address"])
    assert back["incarnation"] == victim["incarnation"] and back["losses"] >= 1
    placed_before = back["requests_placed"]
    assert expected_texts(server, STREAM_PROMPTS[:6]) == expected[:6]
    back = next(e for e in server.executors_state() if e["address"] == victim["address"])
    assert back["requests_placed"] > placed_before, back
    assert back["step_transport"] == "socket", back  # a new socket after the reconnect
    assert_no_blocks_in_use(server)


@pytest.mark.slow
def test_without_a_healthy_executor_requests_wait_then_get_503(default_model_dir, tmp_path):
    """The only executor dies for good: requests in flight wait `--no-executor-timeout`, then
    fail with a clear message (an error event in a stream, a 503 otherwise); new requests
    wait as long, then get a 503; /health and /v1/models show the empty fleet."""
    server = start_server(
        default_model_dir,
        str(tmp_path),
        controller_args=[*FAST_HEALTH, "--no-executor-timeout", "3"],
    )
    body = {
        "model": server.model_name,
        "prompt": PROMPTS[1],
        "max_tokens": 300,
        "temperature": 0,
        "ignore_eos": True,
    }

    async def in_flight():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as http:
            started = asyncio.Event()

            async def stream():
                events = []
                async with http.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}
                ) as resp:
                    async for line in resp.aiter_lines():
                        if line.startswith("data:"):
                            events.append(line[5:].strip())
                            if len(events) == 3:
                                started.set()
                    return resp.status_code, events

            streaming = asyncio.create_task(stream())
            whole = asyncio.create_task(http.post("/v1/completions", json=body))
            await asyncio.wait_for(started.wait(), timeout=120)
            killed = time.perf_counter()
            server.executors[0].send_signal(signal.SIGKILL)
            status, events = await streaming
            response = await whole
            return status, events, response, time.perf_counter() - killed

    try:
        status, events, response, waited = asyncio.run(in_flight())
        assert waited >= 3.0
        assert status == 200 and events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert "No healthy executor" in error["message"], events[-3:]
        assert response.status_code == 503
        assert "No healthy executor" in response.json()["error"]["message"]
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503 and health.json() == {"status": "unavailable"}
        details = httpx.get(server.base_url + "/admin/health")
        assert details.status_code == 503 and details.json()["healthy_executors"] == 0
        (model,) = httpx.get(server.base_url + "/v1/models").json()["data"]
        assert model["executors"]["healthy"] == 0 and model["executors"]["total"] == 1
        for stream in (False, True):
            started = time.time()
            r = httpx.post(
                server.base_url + "/v1/completions",
                json={**body, "max_tokens": 4, "stream": stream},
                timeout=30,
            )
            assert r.status_code == 503, r.text
            assert time.time() - started >= 2.9
            err = r.json()["error"]
            assert "No healthy executor" in err["message"] and err["type"] == "server_error"
    finally:
        server.stop()
