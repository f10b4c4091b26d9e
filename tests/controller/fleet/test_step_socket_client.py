"""The controller's client on an executor's step socket, against a real simulated executor.

Steps go over the socket the executor advertises; a socket the controller cannot reach leaves
the steps on gRPC; a killed, replaced or stopped executor is an ExecutorLost with the status
gRPC would have given, as on the gRPC stream.
"""

from __future__ import annotations

import asyncio
import os
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput
from controller.fleet.client import ExecutorClient, ExecutorLost, grpc_status_of
from tests.support.processes import free_port, spawn_executor, wait_until

PROMPT = list(range(10, 18))  # 8 tokens: one block of 16


def _start_sim(model: str, tmp: str, name: str, step_port: int):
    """A simulated executor serving a step socket on `step_port`; (process, gRPC port)."""
    proc, port = spawn_executor(
        "executor_sim",
        model,
        tmp,
        name,
        extra=["--step-port", str(step_port), "--num-blocks", "16", "--step-fixed-ms", "1"],
    )
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        wait_until(
            lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving,
            120,
            f"the simulated executor {name}",
            logs=tmp,
        )
    return proc, port


def _stop(proc) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait(timeout=30)


@pytest.fixture
def sim(default_model_dir, tmp_path):
    """One simulated executor with a step socket: (process, gRPC port, step port)."""
    step_port = free_port()
    proc, port = _start_sim(default_model_dir, str(tmp_path), "sim", step_port)
    yield proc, port, step_port
    _stop(proc)


async def _connect(port: int, **kw) -> ExecutorClient:
    """A client after its handshake, taking the step socket the executor advertises."""
    client = ExecutorClient(f"127.0.0.1:{port}", owner_id=kw.pop("owner", "ctl-a"), **kw)
    hs = await client.handshake(64, 8, 256, 0)
    client.step_port = hs.info.capabilities.step_socket_port
    return client


def _first(step_id: int, rid: str = "r1") -> StepInput:
    new = NewRequestData(rid, PROMPT, [], SamplingParams(), [1], 0, len(PROMPT))
    return StepInput(step_id, new_requests=[new])


def _decode(step_id: int, computed: int, rid: str = "r1") -> StepInput:
    return StepInput(step_id, cached_requests=[CachedRequestData(rid, [], computed, 1)])


async def _run_steps(client: ExecutorClient, count: int) -> list[int]:
    """A request's prompt, then `count - 1` decode steps, pipelined two deep; its tokens."""
    steps = [_first(1)] + [_decode(i + 1, len(PROMPT) + i - 1) for i in range(1, count)]
    tokens = []
    await client.send_step(steps[0])
    for i, step in enumerate(steps):
        if i + 1 < len(steps):
            await client.send_step(steps[i + 1])
        out = await client.receive_result(step)
        assert out.step_id == step.step_id
        tokens.append(out.sampled_token_ids[0] if out.sampled_token_ids else None)
    return tokens


def test_steps_go_over_the_advertised_step_socket(sim):
    _, port, step_port = sim

    async def run():
        client = await _connect(port)
        assert client.step_port == step_port
        tokens = await _run_steps(client, 6)
        transport = client.step_transport
        await client.close()
        return tokens, transport

    tokens, transport = asyncio.run(run())
    assert transport == "socket"
    assert len(tokens) == 6 and all(isinstance(t, int) and t >= 0 for t in tokens), tokens


def test_an_unreachable_step_socket_leaves_the_steps_on_grpc(sim):
    _, port, _ = sim

    async def run():
        client = await _connect(port)
        client.step_port = free_port()  # nothing listens there (a network policy's drop)
        tokens = await _run_steps(client, 4)
        state = client.step_transport, client.step_port
        await client.close()
        return tokens, state

    tokens, (transport, step_port) = asyncio.run(run())
    assert (transport, step_port) == ("grpc", 0)
    assert len(tokens) == 4 and all(t is not None for t in tokens)


def test_socket_and_grpc_streams_give_the_same_tokens(sim):
    """The simulated sampler is seeded per session: the same steps over gRPC and over the
    socket, each after its own InitDevice, sample the same tokens."""
    _, port, _ = sim

    async def run(use_socket: bool):
        client = await _connect(port)
        if not use_socket:
            client.step_port = 0
        tokens = await _run_steps(client, 8)
        transport = client.step_transport
        await client.close()
        return tokens, transport

    over_grpc, t1 = asyncio.run(run(False))
    over_socket, t2 = asyncio.run(run(True))
    assert (t1, t2) == ("grpc", "socket")
    assert over_socket == over_grpc


def test_a_new_session_ends_the_socket_stream_of_the_old_one(sim):
    _, port, _ = sim

    async def run():
        first = await _connect(port, owner="")
        await _run_steps(first, 2)
        second = await _connect(port, owner="")  # InitDevice: a new session
        with pytest.raises(ExecutorLost) as lost:
            await first.step(_decode(3, len(PROMPT) + 1))
        tokens = await _run_steps(second, 3)  # the new session steps on
        await first.close()
        await second.close()
        return lost.value, tokens

    lost, tokens = asyncio.run(run())
    assert grpc_status_of(lost) in ("ABORTED", "FAILED_PRECONDITION", "CANCELLED", "UNAVAILABLE")
    assert "step stream broke" in str(lost)
    assert len(tokens) == 3


def test_a_killed_executor_is_lost_on_the_socket(default_model_dir, tmp_path):
    proc, port = _start_sim(default_model_dir, str(tmp_path), "victim", free_port())
    try:

        async def run():
            client = await _connect(port)
            await _run_steps(client, 2)
            assert client.step_transport == "socket"
            proc.kill()
            proc.wait(timeout=30)
            with pytest.raises(ExecutorLost) as lost:
                await client.step(_decode(3, len(PROMPT) + 1))
            transport = client.step_transport
            await client.close()
            return lost.value, transport

        lost, transport = asyncio.run(run())
        assert grpc_status_of(lost) == "UNAVAILABLE" or "broke" in str(lost), lost
        assert transport == ""  # the broken socket is closed
    finally:
        _stop(proc)


def test_a_stopped_executor_passes_the_step_timeout_on_the_socket(sim):
    proc, port, _ = sim

    async def run():
        client = await _connect(port, step_timeout=1.0)
        await _run_steps(client, 2)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            with pytest.raises(ExecutorLost) as lost:
                await client.step(_decode(3, len(PROMPT) + 1))
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        await client.close()
        return lost.value

    lost = asyncio.run(run())
    assert "took over 1s" in str(lost)
