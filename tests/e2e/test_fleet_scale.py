"""The control plane at fleet scale, on one machine: one controller in front of 200 simulated
executors (four processes of 50, each executor its own gRPC server) serves 20,000 requests,
and a third of the way through one process is killed, taking 50 executors with it.

Every request must come back whole (those on the lost executors resume elsewhere), every
executor must take part, and afterwards no request may run or wait anywhere, no KV block may
stay in use, and the controller's memory must not have grown over the second half. The run's
rate is printed, not asserted (the machine is shared)."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import time
from collections.abc import Callable

import httpx
import pytest

from tests.support.processes import (
    read_ports_files,
    rss_mib,
    spawn_controller,
    spawn_process,
    wait_healthy_executors,
)

PROCESSES = 4  # simulator processes
PER_PROCESS = 50  # simulated executors in each
REQUESTS = 20_000  # requests served
IN_FLIGHT = 400  # requests the client keeps open
POOL = 20  # client connections per HTTP connection pool

pytestmark = pytest.mark.slow


def start_sims(model: str, tmp: str) -> tuple[list[subprocess.Popen], list[int]]:
    """PROCESSES simulator processes of PER_PROCESS executors; their ports once all serve."""
    procs, files = [], []
    for i in range(PROCESSES):
        ports_file = os.path.join(tmp, f"sim{i}.ports")
        procs.append(
            spawn_process(
                [
                    "-m",
                    "executor_sim",
                    "--model",
                    model,
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--count",
                    str(PER_PROCESS),
                    "--ports-file",
                    ports_file,
                    "--seed",
                    str(1000 * i),
                    "--num-blocks",
                    "256",
                    "--step-fixed-ms",
                    "10",
                    "--step-per-token-us",
                    "10",
                    "--log-level",
                    "WARNING",
                ],
                os.path.join(tmp, f"sim{i}.log"),
            )
        )
        files.append(ports_file)
    return procs, read_ports_files(files, 120, logs=tmp)


async def serve_all(
    base_url: str, model: str, vocab: int, on_result: Callable[[int], None]
) -> list[tuple[int, dict]]:
    """REQUESTS non-streamed completions, IN_FLIGHT at a time: (max_tokens, response).
    ``on_result`` gets the number of responses so far after each one."""
    rng = random.Random(7)
    bodies = iter(
        [
            {
                "model": model,
                "max_tokens": rng.randint(1, 8),
                "ignore_eos": True,
                "prompt": [rng.randrange(100, vocab) for _ in range(rng.randint(4, 40))],
                "temperature": 0,
            }
            for _ in range(REQUESTS)
        ]
    )
    results: list[tuple[int, dict]] = []

    async def client_loop(workers: int) -> None:
        # One small pool per few workers: httpx's pool scans all its connections per request.
        limits = httpx.Limits(max_connections=workers, max_keepalive_connections=workers)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:

            async def worker() -> None:
                for body in bodies:
                    r = await client.post(base_url + "/v1/completions", json=body)
                    assert r.status_code == 200, r.text
                    results.append((body["max_tokens"], r.json()))
                    on_result(len(results))

            await asyncio.gather(*(worker() for _ in range(workers)))

    await asyncio.gather(*(client_loop(POOL) for _ in range(IN_FLIGHT // POOL)))
    return results


def test_twenty_thousand_requests_over_two_hundred_executors_one_process_lost(
    default_model_dir, tmp_path
):
    from common.wire.model_config import load_model_geometry

    tmp = str(tmp_path)
    procs, ports = start_sims(default_model_dir, tmp)
    assert len(ports) == PROCESSES * PER_PROCESS == len(set(ports))
    args = ["--max-queued-requests", "0", "--log-level", "WARNING"]
    for port in ports:
        args += ["--executor", f"127.0.0.1:{port}"]
    server = spawn_controller(default_model_dir, tmp, args)
    server.executors.extend(procs)
    try:
        wait_healthy_executors(server, len(ports), timeout=300)
        vocab = load_model_geometry(default_model_dir).vocab_size
        lost = set(ports[:PER_PROCESS])  # the first process's executors

        rss_mid: list[float] = []

        def kill_one_process(done: int) -> None:
            if done == REQUESTS // 3:
                procs[0].kill()
            if done == REQUESTS // 2:
                rss_mid.append(rss_mib(server.controller.pid))

        started = time.monotonic()
        results = asyncio.run(
            serve_all(server.base_url, server.model_name, vocab, kill_one_process)
        )
        seconds = time.monotonic() - started
        print(
            f"\nFLEET SCALE: {REQUESTS} requests over {len(ports)} executors, "
            f"{len(lost)} of them lost a third of the way, in {seconds:.1f} s "
            f"({REQUESTS / seconds:.0f} requests/s)"
        )

        assert len(results) == REQUESTS
        for max_tokens, body in results:
            assert body["choices"][0]["finish_reason"] == "length"
            assert body["usage"]["completion_tokens"] == max_tokens

        state = server.wait_idle(timeout=60)
        rss_end = rss_mib(server.controller.pid)
        print(f"FLEET SCALE: controller RSS {rss_mid[0]:.0f} MiB halfway, {rss_end:.0f} at the end")
        assert rss_end - rss_mid[0] < 32  # the second 10,000 requests leave nothing behind
        assert len(state) == len(ports)
        unhealthy = {int(e["address"].rsplit(":", 1)[1]) for e in state if not e["healthy"]}
        assert unhealthy == lost
        assert all(e["running"] == 0 and e["waiting"] == 0 for e in state), state
        assert all(e["used_blocks"] == 0 for e in state if e["healthy"])  # no KV block leaked
        placed = [e["requests_placed"] for e in state]
        assert sum(placed) >= REQUESTS and min(placed) > 0, placed  # every executor served
        metrics = httpx.get(server.base_url + "/metrics", timeout=30).text

        def total(prefix: str, label: str = "") -> float:
            return sum(
                float(line.split()[-1])
                for line in metrics.splitlines()
                if line.startswith(prefix) and label in line
            )

        assert total("vllm:request_success_total{", 'finished_reason="length"') == REQUESTS
        moved = total("tandem:requests_failed_over_total{")
        print(f"FLEET SCALE: {moved:.0f} requests moved off the lost executors")
        assert moved > 0
    finally:
        server.stop()
