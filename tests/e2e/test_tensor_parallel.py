"""A tensor-parallel GPU executor through the real controller (2 ranks on the CPU, gloo).

The default model sharded unevenly (9 query / 3 key-value heads over 2 ranks: 6+3 and 2+1)
serves transformers' greedy tokens through chunked prefill, preemption and prefix-cache hits;
the controller reports the executor's parallelism. A follower rank killed mid-stream ends its
executor at once (device-failure status) and the controller moves the streams to the other
executor, where they finish with the texts of a run without the fault.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import psutil
import pytest

from tests.e2e.helpers import (
    PROMPTS,
    assert_exact_under_pressure,
    assert_no_blocks_in_use,
    expected_texts,
    metric_sum,
    metrics_text,
    stream_completion,
)
from tests.support.processes import (
    FAST_HEALTH,
    spawn_controller,
    spawn_executor,
    start_server,
    wait_healthy_executors,
)

TP = ["--tensor-parallel-size", "2"]
EXIT_DEVICE_FAILED = 70


def _follower(executor: psutil.Process) -> psutil.Process:
    """The follower rank among an executor's children (not multiprocessing's resource
    tracker)."""
    for child in executor.children():
        cmdline = " ".join(child.cmdline())
        if "spawn_main" in cmdline:
            return child
    raise AssertionError(f"no follower among {executor.children()}")


@pytest.mark.slow
def test_two_ranks_serve_transformers_greedy_under_pressure(default_model_dir, hf, tmp_path):
    server = start_server(
        default_model_dir,
        str(tmp_path),
        controller_args=["--max-num-batched-tokens", "48", "--num-kv-blocks", "20"],
        executor_args=TP,
    )
    try:
        (state,) = server.executors_state()
        assert state["tensor_parallel_size"] == 2 and state["device"].endswith("x2"), state
        info = [
            line
            for line in metrics_text(server).splitlines()
            if line.startswith("tandem:executor_info{")
        ]
        assert len(info) == 1 and 'tensor_parallel_size="2"' in info[0], info
        assert_exact_under_pressure(server, hf)
    finally:
        server.stop()


@pytest.mark.slow
def test_rank_killed_mid_stream_fails_over(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    sharded, sharded_port = spawn_executor("executor_gpu", default_model_dir, tmp, "tp2", extra=TP)
    single, single_port = spawn_executor("executor_gpu", default_model_dir, tmp, "tp1")
    server = spawn_controller(
        default_model_dir,
        tmp,
        [
            *FAST_HEALTH,
            "--executor",
            f"127.0.0.1:{sharded_port}",
            "--executor",
            f"127.0.0.1:{single_port}",
        ],
    )
    server.executors, server.executor_ports = [sharded, single], [sharded_port, single_port]
    prompts = [f"{p} (story {i})" for i, p in enumerate(PROMPTS * 3)]
    try:
        wait_healthy_executors(server, 2, timeout=600)
        expected = expected_texts(server, prompts)  # both executors, no fault
        follower = _follower(psutil.Process(sharded.pid))

        async def run():
            started = asyncio.Event()
            tasks = [
                asyncio.create_task(stream_completion(server, p, [], started)) for p in prompts
            ]
            await asyncio.wait_for(started.wait(), timeout=120)
            async with httpx.AsyncClient(base_url=server.base_url, timeout=10) as http:
                state = (await http.get("/admin/executors")).json()["executors"]
            victim = next(e for e in state if e["address"].endswith(f":{sharded_port}"))
            assert victim["requests"] > 0, state
            t_kill = time.perf_counter()
            os.kill(follower.pid, signal.SIGKILL)
            texts = await asyncio.wait_for(asyncio.gather(*tasks), timeout=300)
            return texts, victim["requests"], t_kill

        texts, moved, t_kill = asyncio.run(run())
        assert texts == expected
        # The executor ended itself with the device-failure status, without hanging.
        assert sharded.wait(timeout=60) == EXIT_DEVICE_FAILED
        print(
            f"\nTP rank killed: {moved} requests on the executor, "
            f"it exited {time.perf_counter() - t_kill:.1f}s after the kill (at most)"
        )
        assert metric_sum(metrics_text(server), "tandem:requests_failed_over_total") >= moved
        assert_no_blocks_in_use(server)
    finally:
        server.stop()
