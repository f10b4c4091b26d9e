"""The chart's Grafana dashboard against a real Prometheus scraping a live mixed fleet.

A controller with a GPU-kind executor (on the CPU: accelerator "cpu") and a TPU executor (XLA on
the CPU: accelerator "tpu"), each serving its own metrics port; a short streaming load with
shared prefixes; the TPU executor killed mid-load (so failover, lost-executor and gRPC-error
series are real). Then every panel query of the dashboard must return data, the per-accelerator
panels must show both kinds, no request may fail, and promtool must accept every exposition.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import signal
import time

import httpx
import pytest

from tests.e2e.helpers import metric_sum
from tests.e2e.prom import PrometheusServer, promtool_problems
from tests.support.processes import (
    ROOT,
    executor_module_available,
    free_port,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
    wait_until,
)

pytestmark = pytest.mark.slow

DASHBOARD = os.path.join(ROOT, "charts/tandem/dashboards/tandem-overview.json")
RATE_WINDOW = "1m"  # stands for $__rate_interval: covers the whole load
LOAD_SECONDS = 24.0
KILL_AFTER = 14.0
# The TPU executor is killed only once it has run this many steps (a loaded machine can leave
# it without a finished request at KILL_AFTER, and then its panels rightly have no data); the
# load goes on until the kill, for at most LOAD_LIMIT seconds.
TPU_STEPS_BEFORE_KILL = 10
LOAD_LIMIT = 120.0
CONCURRENCY = 8
# Panels whose series are split by accelerator kind: both kinds must show up.
BY_ACCELERATOR = (
    "Generated tokens/s by accelerator",
    "TTFT p90 by accelerator",
    "Inter-token latency p50/p90 by accelerator",
    "Step time by accelerator",
)


def panel_queries() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target, with the dashboard variables filled in."""
    with open(DASHBOARD) as f:
        dashboard = json.load(f)
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            expr = (
                target["expr"]
                .replace("$__rate_interval", RATE_WINDOW)
                .replace("$model_name", ".*")
                .replace("$accelerator", ".*")
            )
            out.append((panel["title"], expr))
    return out


async def _load(
    base_url: str, model: str, until: float, kill_at: float, kill, may_kill
) -> list[str]:
    """Streaming completions from CONCURRENCY workers until `until`; `kill()` at `kill_at` or
    later, once `may_kill()` says so (the load goes on until then, LOAD_LIMIT at most).
    Returns the failures (there must be none)."""
    rng = random.Random(7)
    docs = [
        f"Document {d}: " + " ".join(f"fact {i} is that the cat {d} sat." for i in range(12))
        for d in range(3)
    ]
    failures: list[str] = []
    killed = False
    limit = kill_at + LOAD_LIMIT

    async def worker(client: httpx.AsyncClient) -> None:
        nonlocal killed
        while time.monotonic() < until or (not killed and time.monotonic() < limit):
            if not killed and time.monotonic() >= kill_at and may_kill():
                killed = True
                kill()
            body = {
                "model": model,
                "prompt": f"{rng.choice(docs)} Question {rng.random()}:",
                "max_tokens": rng.randint(6, 20),
                "temperature": 0,
                "stream": True,
                "ignore_eos": True,
            }
            tokens, done = 0, False
            try:
                async with client.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code != 200:
                        failures.append(f"HTTP {r.status_code}: {await r.aread()!r}")
                        continue
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            done = True
                        elif line.startswith("data: "):
                            tokens += 1
            except httpx.HTTPError as exc:
                failures.append(repr(exc))
                continue
            if not done or tokens < body["max_tokens"]:
                failures.append(f"incomplete stream: {tokens} chunks, done={done}")

    async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
        await asyncio.gather(*(worker(client) for _ in range(CONCURRENCY)))
    return failures


@pytest.mark.skipif(not executor_module_available("executor_tpu"), reason="no executor_tpu")
def test_every_dashboard_panel_has_data(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    gpu_metrics, tpu_metrics = free_port(), free_port()
    gpu, gpu_port = spawn_executor(
        "executor_gpu",
        default_model_dir,
        tmp,
        "executor-gpu",
        extra=["--metrics-port", str(gpu_metrics), "--kv-cache-bytes", str(256 << 20)],
    )
    tpu, tpu_port = spawn_executor(
        "executor_tpu",
        default_model_dir,
        tmp,
        "executor-tpu",
        extra=["--metrics-port", str(tpu_metrics), "--kv-cache-bytes", str(256 << 20)],
    )
    server = spawn_controller(
        default_model_dir,
        tmp,
        [
            "--executor",
            f"127.0.0.1:{gpu_port}",
            "--executor",
            f"127.0.0.1:{tpu_port}",
            "--executor-limits",
            "tpu=64,8",
            "--health-check-interval",
            "0.5",
        ],
    )
    server.executors = [gpu, tpu]
    prometheus = None
    try:
        wait_healthy_executors(server, 2, timeout=900)
        host = server.base_url.removeprefix("http://")
        prometheus = PrometheusServer(
            tmp,
            {
                "controller": [host],
                "executors": [f"127.0.0.1:{gpu_metrics}", f"127.0.0.1:{tpu_metrics}"],
            },
        )
        wait_until(
            lambda: all(prometheus.targets_up().values()) and len(prometheus.targets_up()) == 3,
            30,
            "all targets scraped",
        )
        tpu_exposition = {}

        def kill_tpu() -> None:
            tpu_exposition["text"] = httpx.get(f"http://127.0.0.1:{tpu_metrics}/metrics").text
            os.killpg(tpu.pid, signal.SIGKILL)

        checked = {"at": 0.0, "ok": False}

        def tpu_has_served() -> bool:
            """Whether the TPU executor has run TPU_STEPS_BEFORE_KILL steps (asked twice a
            second at most)."""
            if not checked["ok"] and time.monotonic() - checked["at"] > 0.5:
                checked["at"] = time.monotonic()
                text = httpx.get(f"http://127.0.0.1:{tpu_metrics}/metrics", timeout=5).text
                steps = metric_sum(text, "tandem:executor_step_seconds_count")
                checked["ok"] = steps >= TPU_STEPS_BEFORE_KILL
            return checked["ok"]

        start = time.monotonic()
        failures = asyncio.run(
            _load(
                server.base_url,
                server.model_name,
                start + LOAD_SECONDS,
                start + KILL_AFTER,
                kill_tpu,
                tpu_has_served,
            )
        )
        assert not failures, failures[:5]
        state = server.wait_idle(60)
        assert any(not e["healthy"] for e in state), state
        time.sleep(3)  # a few more scrapes after the load

        empty, missing_kind = [], []
        for title, expr in panel_queries():
            result = prometheus.query(expr)
            values = [float(r["value"][1]) for r in result]
            if not any(math.isfinite(v) for v in values):
                empty.append(f"{title}: {expr} -> {result}")
            if title in BY_ACCELERATOR:
                kinds = {
                    r["metric"].get("accelerator")
                    for r in result
                    if math.isfinite(float(r["value"][1]))
                }
                if not {"cpu", "tpu"} <= kinds:
                    missing_kind.append(f"{title}: {expr} -> {sorted(map(str, kinds))}")
        assert not empty, "panels without data:\n" + "\n".join(empty)
        assert not missing_kind, "panels missing a kind:\n" + "\n".join(missing_kind)
        failed_over = prometheus.query("sum(tandem:requests_failed_over_total)")
        lost = prometheus.query('sum(tandem:executor_lost_total{accelerator="tpu"})')
        assert float(lost[0]["value"][1]) >= 1

        for name, text in (
            ("controller", httpx.get(server.base_url + "/metrics").text),
            ("executor_gpu", httpx.get(f"http://127.0.0.1:{gpu_metrics}/metrics").text),
            ("executor_tpu", tpu_exposition["text"]),
        ):
            assert promtool_problems(text) == [], name
        print(f"failed over: {failed_over[0]['value'][1]} requests")
    finally:
        if prometheus is not None:
            prometheus.stop()
        server.stop()
