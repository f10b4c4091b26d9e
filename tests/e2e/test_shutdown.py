"""Graceful shutdown.

- SIGTERM on the controller: new requests get 503 at once, /health says draining, running
  responses finish within the grace period, the rest end with finish_reason "abort" (streams
  get a final chunk and [DONE]), then the process exits cleanly.
- SIGTERM on one of two executors: it reports NOT_SERVING, the controller moves its requests
  to the other one, and every stream completes with exactly the greedy text.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.e2e.helpers import PROMPTS, assert_no_blocks_in_use
from tests.support.processes import FAST_HEALTH, start_server, wait_healthy_executors

GRACE = 4.0  # the controller's --shutdown-grace in these tests


async def _stream(base_url: str, body: dict, events: list[dict]) -> str:
    """Stream a completion; collect its events; return the text."""
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", base_url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    payload = line[len("data: ") :]
                    events.append({"done": True} if payload == "[DONE]" else json.loads(payload))
    return "".join(c["text"] for e in events for c in e.get("choices", ()))


def _finish(events: list[dict]) -> str | None:
    reasons = [
        c["finish_reason"] for e in events for c in e.get("choices", ()) if c.get("finish_reason")
    ]
    return reasons[-1] if reasons else None


@pytest.mark.slow
def test_controller_sigterm_drains_then_aborts(default_model_dir, tmp_path):
    s = start_server(
        default_model_dir,
        str(tmp_path),
        controller_args=["--shutdown-grace", str(GRACE), "--retry-after", "3"],
    )
    try:
        long_body = {
            "model": s.model_name,
            "max_tokens": 2000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        short_body = {
            "model": s.model_name,
            "prompt": PROMPTS[1],
            "max_tokens": 12,
            "temperature": 0,
            "stream": True,
        }

        async def run():
            long_events = [[] for _ in range(3)]
            short_events: list[dict] = []
            tasks = [
                asyncio.create_task(_stream(s.base_url, {**long_body, "prompt": p}, ev))
                for p, ev in zip(PROMPTS, long_events)
            ]
            while not all(long_events):  # every long stream has started
                await asyncio.sleep(0.05)
            short = asyncio.create_task(_stream(s.base_url, short_body, short_events))
            # The short request must be admitted before the signal (a fixed pause raced a busy
            # machine: the request arrived after SIGTERM and got its 503).
            while sum(e["running"] + e["waiting"] for e in s.executors_state()) < 4:
                await asyncio.sleep(0.02)
            s.controller.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(timeout=10) as http:
                refused = await http.post(
                    s.base_url + "/v1/completions", json={**short_body, "stream": False}
                )
                health = await http.get(s.base_url + "/health")
            await asyncio.gather(*tasks, short)
            return long_events, short_events, refused, health, time.monotonic() - signalled

        long_events, short_events, refused, health, took = asyncio.run(run())
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "shutting_down"
        assert refused.headers["retry-after"] == "3"
        assert health.status_code == 503 and health.json()["status"] == "draining"
        assert _finish(short_events) == "length"  # finished within the grace period
        for events in long_events:
            assert _finish(events) == "abort", events[-3:]
            assert events[-1] == {"done": True}
        assert GRACE - 0.5 <= took <= GRACE + 10, took
        assert s.controller.wait(timeout=30) == 0
    finally:
        s.stop()


@pytest.mark.slow
def test_executor_sigterm_loses_no_request(default_model_dir, tmp_path):
    s = start_server(
        default_model_dir,
        str(tmp_path),
        controller_args=FAST_HEALTH,
        executor_kinds=("executor_gpu",) * 2,
    )
    try:
        wait_healthy_executors(s, 2)
        prompts = [f"{p} (story {i})" for i, p in enumerate(PROMPTS * 2)]
        base = {"model": s.model_name, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
        expected = [
            httpx.post(
                s.base_url + "/v1/completions", json={**base, "prompt": p}, timeout=120
            ).json()["choices"][0]["text"]
            for p in prompts
        ]

        async def run():
            events = [[] for _ in prompts]
            tasks = [
                asyncio.create_task(_stream(s.base_url, {**base, "prompt": p, "stream": True}, ev))
                for p, ev in zip(prompts, events)
            ]
            while sum(len(ev) for ev in events) < 3 * len(prompts):
                await asyncio.sleep(0.05)
            placed = {e["address"]: e["running"] + e["waiting"] for e in s.executors_state()}
            s.executors[0].send_signal(signal.SIGTERM)
            texts = await asyncio.gather(*tasks)
            return texts, events, placed

        texts, events, placed = asyncio.run(run())
        assert placed.get(f"127.0.0.1:{s.executor_ports[0]}", 0) > 0, placed
        assert texts == expected
        assert all(_finish(ev) == "length" for ev in events)
        assert s.executors[0].wait(timeout=30) == 0  # drained, then exited cleanly
        assert_no_blocks_in_use(s)
        metrics = httpx.get(s.base_url + "/metrics", timeout=10).text
        assert "tandem:requests_failed_over" in metrics
    finally:
        s.stop()
