"""Executor ownership by lease, with real processes: one simulated executor, controllers
pointed at it. The executor grants its session to one controller at a time; a second
controller waits (owned_elsewhere) while the owner's lease lives; the owner gone (SIGKILL),
stopped past its lease (SIGSTOP) or shut down (SIGTERM, which releases at once), the other
takes the executor over, and a stale owner is fenced: its old session can no longer step and
it does not get the executor back while the new owner's lease lives. The takeover times are
printed (pytest -s) for the report."""

from __future__ import annotations

import queue
import signal
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.ownership import OWNER_TRAILER, SESSION_METADATA
from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from tests.e2e.adversarial.isolation_support import SIM_SPEED, complete, greedy
from tests.support.processes import FAST_HEALTH, spawn_controller, spawn_executor, wait_until

LEASE = 6.0  # the controllers' lease: renewed every 2 s
OWNERSHIP = [*FAST_HEALTH, "--executor-lease-seconds", str(LEASE)]
SLACK = 10.0  # a handshake and a loaded 2-core machine's scheduling


def _state(server) -> dict:
    (state,) = server.executors_state()
    return state


def _owns(server) -> dict | None:
    state = _state(server)
    return state if state["healthy"] and state["owned"] else None


def _refused_by(server, owner: str) -> bool:
    state = _state(server)
    return state["state"] == "owned_elsewhere" and state["owner"] == owner


def _serves(server) -> None:
    status, body, _ = complete(server, greedy([11, 12, 13, 14]), timeout=60)
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 12


def _controller(model: str, tmp: str, port: int, name: str):
    return spawn_controller(model, tmp, [*OWNERSHIP, "--executor", f"127.0.0.1:{port}"], name)


def _takeover(server, since: float, what: str, logs: str) -> tuple[dict, float]:
    state = wait_until(lambda: _owns(server), LEASE + SLACK + 20, what, logs=logs)
    return state, time.monotonic() - since


def test_one_owner_at_a_time_with_takeover_and_fencing(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    executor, port = spawn_executor("executor_sim", default_model_dir, tmp, "sim", extra=SIM_SPEED)
    a = _controller(default_model_dir, tmp, port, "a")
    b = c = None
    try:
        owner_a = wait_until(lambda: _owns(a), 120, "a to own the executor", logs=tmp)["owner"]
        b = _controller(default_model_dir, tmp, port, "b")
        wait_until(lambda: _refused_by(b, owner_a), 120, "b refused (owned by a)", logs=tmp)
        assert httpx.get(b.base_url + "/health", timeout=10).status_code == 503  # owns nothing
        _serves(a)
        time.sleep(LEASE)  # a renews: b still cannot take the executor
        assert _refused_by(b, owner_a)
        assert _state(a)["losses"] == 0
        _serves(a)

        # SIGSTOP the owner past its lease: b takes over.
        a.controller.send_signal(signal.SIGSTOP)
        stopped = time.monotonic()
        state_b, stop_takeover = _takeover(b, stopped, "b to take over from a stopped a", tmp)
        owner_b = state_b["owner"]
        assert owner_b != owner_a
        assert stop_takeover <= LEASE + LEASE / 3 + SLACK
        _serves(b)
        # SIGCONT: a's old session is fenced; it does not get the executor back.
        a.controller.send_signal(signal.SIGCONT)
        wait_until(lambda: _refused_by(a, owner_b), 60, "a refused (owned by b)", logs=tmp)
        fenced = _state(a)
        assert fenced["losses"] == 1 and not fenced["owned"]
        assert "stale" in fenced["last_loss"] or "CANCELLED" in fenced["last_loss"]
        time.sleep(LEASE)
        assert _refused_by(a, owner_b) and _owns(b)
        _serves(b)

        # SIGKILL the owner: a takes over once b's lease expires.
        b.controller.send_signal(signal.SIGKILL)
        b.controller.wait(timeout=30)
        killed = time.monotonic()
        _, kill_takeover = _takeover(a, killed, "a to take over from a killed b", tmp)
        assert kill_takeover <= LEASE + LEASE / 3 + SLACK
        _serves(a)

        # SIGTERM the owner: it releases the executor, c takes it at once.
        owner_a = _state(a)["owner"]
        c = _controller(default_model_dir, tmp, port, "c")
        wait_until(lambda: _refused_by(c, owner_a), 120, "c refused (owned by a)", logs=tmp)
        a.controller.send_signal(signal.SIGTERM)
        terminated = time.monotonic()
        _, term_takeover = _takeover(c, terminated, "c to take over from a stopping a", tmp)
        assert a.controller.wait(timeout=60) == 0
        assert term_takeover < LEASE  # the release, not the lease's expiry
        _serves(c)
        print(
            f"\ntakeover after SIGSTOP {stop_takeover:.2f}s, SIGKILL {kill_takeover:.2f}s, "
            f"SIGTERM {term_takeover:.2f}s (lease {LEASE:g}s, renewed every {LEASE / 3:g}s)"
        )
    finally:
        for server in (a, b, c):
            if server is not None:
                if server.controller.poll() is None:
                    server.controller.send_signal(signal.SIGCONT)
                server.stop()
        executor.send_signal(signal.SIGTERM)
        executor.wait(timeout=30)


@pytest.fixture
def sim_stub(default_model_dir, tmp_path):
    """A simulated executor's stub, with no controller."""
    tmp = str(tmp_path)
    executor, port = spawn_executor("executor_sim", default_model_dir, tmp, "sim", extra=SIM_SPEED)
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    serving = health_pb2.HealthCheckResponse.SERVING
    wait_until(
        lambda: health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == serving,
        120,
        "the executor",
        logs=tmp,
    )
    yield pb_grpc.ExecutorStub(channel)
    channel.close()
    executor.send_signal(signal.SIGTERM)
    executor.wait(timeout=30)


def _init(stub, owner: str, lease: float = 30.0) -> pb.InitDeviceResponse:
    request = pb.InitDeviceRequest(
        max_num_batched_tokens=64, max_num_seqs=4, owner_id=owner, lease_seconds=lease
    )
    return stub.InitDevice(request, timeout=60)


def _session(generation: int) -> tuple:
    return ((SESSION_METADATA, str(generation)),)


def _stream(stub, metadata):
    requests: queue.Queue = queue.Queue()
    responses = stub.ExecuteModel(iter(requests.get, None), metadata=metadata, timeout=60)
    return requests, responses


def test_the_executor_refuses_other_owners_and_stale_sessions(sim_stub):
    granted = _init(sim_stub, "ctl-a")
    gen = granted.generation
    assert gen >= 1 and granted.lease_seconds == 30.0
    with pytest.raises(grpc.RpcError) as refused:
        _init(sim_stub, "ctl-b")
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "ctl-a" in refused.value.details()
    assert dict(refused.value.trailing_metadata())[OWNER_TRAILER] == "ctl-a"
    with pytest.raises(grpc.RpcError) as anonymous:  # ownerless: refused while a's lease lives
        _init(sim_stub, "")
    assert anonymous.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    init_cache = pb.InitializeCacheRequest(num_blocks=16)
    sim_stub.InitializeCache(init_cache, metadata=_session(gen), timeout=60)
    for metadata in (_session(gen - 1), _session(gen + 5), ()):  # stale, unknown, none
        requests, responses = _stream(sim_stub, metadata)
        requests.put(pb.StepRequest(step_id=1))
        with pytest.raises(grpc.RpcError) as stale:
            next(responses)
        assert stale.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        requests.put(None)
    assert sim_stub.RenewLease(pb.LeaseRequest(owner_id="ctl-a", generation=gen)).lease_seconds
    requests, responses = _stream(sim_stub, _session(gen))
    requests.put(pb.StepRequest(step_id=1))
    assert next(responses).step_id == 1
    with pytest.raises(grpc.RpcError) as not_owner:
        sim_stub.ReleaseSession(pb.LeaseRequest(owner_id="ctl-b", generation=gen))
    assert not_owner.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    sim_stub.ReleaseSession(pb.LeaseRequest(owner_id="ctl-a", generation=gen))
    taken = _init(sim_stub, "ctl-b")  # at once after the release
    assert taken.generation > gen
    requests.put(pb.StepRequest(step_id=2))
    with pytest.raises(grpc.RpcError) as fenced:  # a's open stream ended by b's InitDevice
        next(responses)
    assert fenced.value.code() in (grpc.StatusCode.CANCELLED, grpc.StatusCode.FAILED_PRECONDITION)
    requests.put(None)
    with pytest.raises(grpc.RpcError) as renew:
        sim_stub.RenewLease(pb.LeaseRequest(owner_id="ctl-a", generation=gen))
    assert renew.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale" in renew.value.details()
