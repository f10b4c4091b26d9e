"""Soak: waves of hundreds of concurrent streams, many of them dropped by their clients at
random points. Afterwards nothing runs, no KV block is held, the controller's memory has not
grown beyond a generous slack, and it still serves the same greedy completion.

The memory-budget soak adds what costs the controller memory per request: long prompts, 16
stop strings of 1,024 characters, 20 logprobs per token, several choices, and disconnects
while queued or mid-stream; the controller's resident memory, sampled throughout, stays within
the budget of docs/operations.md ("Memory budget")."""

from __future__ import annotations

import asyncio
import os
import random
import time

import httpx
import pytest

from tests.e2e.helpers import LONG_PROMPT, PROMPTS, assert_no_blocks_in_use, gauge
from tests.support.processes import PeakRSS, rss_mib, start_server

CONCURRENCY = 300  # streams per wave
SOAK_SECONDS = 45.0  # waves start until this much time has passed
RSS_SLACK_MIB = 100  # allowed growth of the controller's resident memory
MEMORY_BUDGET_MIB = 256  # docs/operations.md: peak growth over the warm controller under load
BUDGET_WAVE = 120  # requests per wave of the memory-budget soak
WAVE_SECONDS = 25.0  # a wave's clients leave at this point, queued or not
BUDGET_SECONDS = 60.0  # its waves start until this much time has passed
REFERENCE = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}


async def _stream(http: httpx.AsyncClient, url: str, body: dict, leave_after: int | None):
    """One streamed completion; leaves after `leave_after` events (None: reads to the end).
    Returns "done", "left" or the HTTP status of a refusal."""
    async with http.stream("POST", url, json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return str(resp.status_code)
        events, finished, last = 0, False, ""
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            if line == "data: [DONE]":
                return "done" if finished else f"no-finish: {body} -> {last[:400]}"
            events += 1
            last = line
            finished = finished or '"finish_reason":"' in line.replace(" ", "")
            if leave_after is not None and events >= leave_after:
                return "left"
        return "truncated"


async def _wave(base_url: str, model: str, rng: random.Random, size: int) -> list[str]:
    limits = httpx.Limits(max_connections=size + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = []
        for i in range(size):
            body = {
                "model": model,
                "prompt": f"{rng.choice(PROMPTS)} ({i})",
                "max_tokens": rng.randint(2, 12),
                "temperature": rng.choice([0, 0.8]),
                "stream": True,
            }
            roll = rng.random()
            leave_after = rng.randint(1, 4) if roll < 0.3 else None
            task = asyncio.create_task(
                _stream(http, base_url + "/v1/completions", body, leave_after)
            )
            if roll > 0.9:  # gone before (or just after) the response starts
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 1.0), task.cancel)
            tasks.append(task)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return [
        "cancelled"
        if isinstance(r, asyncio.CancelledError)
        else f"error:{r!r}"
        if isinstance(r, BaseException)
        else r
        for r in results
    ]


def _warnings(log_dir: str) -> list[str]:
    """The controller's last warnings and errors: what a failed soak shows of the server."""
    with open(os.path.join(log_dir, "controller.log"), errors="replace") as f:
        return [line[:500] for line in f if " WARNING " in line or " ERROR " in line][-20:]


@pytest.fixture(scope="module")
def soak_server(default_model_dir, tmp_path_factory):
    s = start_server(default_model_dir, str(tmp_path_factory.mktemp("soak")))
    yield s
    s.stop()


@pytest.mark.slow
def test_soak_streams_with_random_disconnects(soak_server):
    s = soak_server
    rng = random.Random(1234)
    reference = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()
    warm = asyncio.run(_wave(s.base_url, s.model_name, rng, 100))
    assert not [r for r in warm if r.startswith("error") or r in ("no-finish", "truncated")]
    s.wait_idle()
    rss_warm = rss_mib(s.controller.pid)

    outcomes: dict[str, int] = {}
    examples: list[str] = []
    started, waves = time.monotonic(), 0
    while time.monotonic() - started < SOAK_SECONDS:
        for r in asyncio.run(_wave(s.base_url, s.model_name, rng, CONCURRENCY)):
            key = r.split(":")[0]
            outcomes[key] = outcomes.get(key, 0) + 1
            if key not in ("done", "left", "cancelled") and len(examples) < 5:
                examples.append(r)  # the request and what its stream said last
        waves += 1
    assert waves >= 1
    assert outcomes.get("done", 0) > CONCURRENCY // 2, outcomes
    assert outcomes.get("left", 0) > 0 and outcomes.get("cancelled", 0) > 0, outcomes
    bad = {k: v for k, v in outcomes.items() if k not in ("done", "left", "cancelled")}
    assert not bad, (outcomes, examples, _warnings(s.log_dir))

    assert_no_blocks_in_use(s)
    state = httpx.get(s.base_url + "/admin/executors", timeout=10).json()["admission"]
    assert state["active_responses"] == 0 and state["queued_requests"] == 0, state
    metrics = httpx.get(s.base_url + "/metrics", timeout=10).text
    assert gauge(metrics, "vllm:num_requests_running") == 0
    assert gauge(metrics, "vllm:kv_cache_usage_perc") == 0
    rss_after = rss_mib(s.controller.pid)
    assert rss_after - rss_warm < RSS_SLACK_MIB, (rss_warm, rss_after)
    again = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]
    print(f"soak: {waves} waves, {outcomes}, controller RSS {rss_warm:.0f} -> {rss_after:.0f} MiB")


def _heavy_body(rng: random.Random, model: str, i: int) -> dict:
    """A request that costs the controller memory: a distinct prompt, a quarter of them long
    (~1,100 tokens), often 16 stop strings of 1,024 characters, 20 logprobs per token,
    several choices."""
    long = rng.random() < 0.25
    text = LONG_PROMPT * 5 if long else rng.choice(PROMPTS) + LONG_PROMPT[: rng.randint(0, 300)]
    body = {
        "model": model,
        "prompt": f"{i} {rng.random()} {text}",
        "max_tokens": rng.randint(2, 6),
        "temperature": rng.choice([0, 0.8]),
        "stream": True,
        "n": rng.choice([1, 1, 2, 4]),
    }
    if rng.random() < 0.5:
        body["stop"] = [f"{k:02d}" + "never " * 170 for k in range(16)]
    if rng.random() < 0.5:
        body["logprobs"] = 20
    return body


async def _heavy_wave(base_url: str, model: str, rng: random.Random, size: int) -> list[str]:
    limits = httpx.Limits(max_connections=size + 10, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        tasks = []
        for i in range(size):
            roll = rng.random()
            leave_after = rng.randint(1, 3) if roll < 0.3 else None
            body = _heavy_body(rng, model, i)
            task = asyncio.create_task(
                _stream(http, base_url + "/v1/completions", body, leave_after)
            )
            if roll > 0.8:  # gone while queued, or soon after its first tokens
                asyncio.get_running_loop().call_later(rng.uniform(0.0, 3.0), task.cancel)
            tasks.append(task)
        _, late = await asyncio.wait(tasks, timeout=WAVE_SECONDS)
        for task in late:  # the wave's end: its clients leave, queued or mid-stream
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
    return [
        "cancelled"
        if isinstance(r, asyncio.CancelledError)
        else f"error:{r!r}"
        if isinstance(r, BaseException)
        else r
        for r in results
    ]


@pytest.mark.slow
def test_memory_budget_soak(soak_server):
    s = soak_server
    rng = random.Random(4321)
    reference = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()
    asyncio.run(_heavy_wave(s.base_url, s.model_name, rng, 20))  # warm the caches
    assert_no_blocks_in_use(s)
    rss_warm = rss_mib(s.controller.pid)
    outcomes: dict[str, int] = {}
    started, waves = time.monotonic(), 0
    with PeakRSS(s.controller.pid) as rss:
        while time.monotonic() - started < BUDGET_SECONDS:
            for r in asyncio.run(_heavy_wave(s.base_url, s.model_name, rng, BUDGET_WAVE)):
                key = r.split(":")[0]
                outcomes[key] = outcomes.get(key, 0) + 1
            waves += 1
    assert outcomes.get("done", 0) > 0 and outcomes.get("cancelled", 0) > 0, outcomes
    bad = {k: v for k, v in outcomes.items() if k not in ("done", "left", "cancelled", "429")}
    assert not bad, outcomes
    assert rss.peak - rss_warm < MEMORY_BUDGET_MIB, (rss_warm, rss.peak)
    assert_no_blocks_in_use(s)
    state = httpx.get(s.base_url + "/admin/executors", timeout=10).json()["admission"]
    assert state["active_responses"] == 0 and state["queued_requests"] == 0, state
    again = httpx.post(s.base_url + "/v1/completions", json=REFERENCE, timeout=60).json()
    assert again["choices"][0]["text"] == reference["choices"][0]["text"]
    print(
        f"memory soak: {waves} waves, {outcomes}, controller RSS {rss_warm:.0f} MiB warm, "
        f"{rss.peak:.0f} MiB peak, {rss_mib(s.controller.pid):.0f} MiB after"
    )
