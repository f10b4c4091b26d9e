"""Live servers shared by the end-to-end tests: real executor and controller processes."""

from __future__ import annotations

import os
import signal

import pytest

from tests.support.processes import (
    FAST_HEALTH,
    LiveServer,
    start_server,
    wait_healthy_executors,
)


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory) -> LiveServer:
    """The default configuration: one executor, default budgets."""
    s = start_server(default_model_dir, str(tmp_path_factory.mktemp("server")))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tight_server(default_model_dir, tmp_path_factory) -> LiveServer:
    """A small step budget and few KV blocks: chunked prefill and preemption for sure; its
    steps go over the executor's step socket (--step-port)."""
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("tight")),
        controller_args=["--max-num-batched-tokens", "48", "--num-kv-blocks", "20"],
        step_sockets=True,
    )
    yield s
    s.stop()


@pytest.fixture(scope="session")
def executor_pair(default_model_dir, tmp_path_factory) -> LiveServer:
    """Two GPU executors (the CPU here) behind one controller, with fast failure detection,
    driven over their step sockets (--step-port): the failures below break those connections.
    Tests that kill or stop one must leave both healthy again."""
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("pair")),
        controller_args=FAST_HEALTH,
        executor_kinds=("executor_gpu",) * 2,
        step_sockets=True,
    )
    wait_healthy_executors(s, 2)
    yield s
    for p in s.executors:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    s.stop()
