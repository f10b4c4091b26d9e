"""One step stream at a time: a new ExecuteModel stream (or a new session's InitDevice)
replaces the open one, which ends ABORTED with a clear message at its next step instead of
driving the device beside the new one."""

from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from tests.support.processes import spawn_executor, wait_until
from tests.support.step_streams import GrpcStepStream


@pytest.fixture(scope="module")
def bare_executor(default_model_dir, tmp_path_factory):
    """An executor with no controller, handshaken by the test."""
    tmp = str(tmp_path_factory.mktemp("sessions"))
    proc, port = spawn_executor("executor_gpu", default_model_dir, tmp, "executor")
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    wait_until(
        lambda: (
            health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            == health_pb2.HealthCheckResponse.SERVING
        ),
        300,
        "the executor",
        logs=tmp,
    )
    stub = pb_grpc.ExecutorStub(channel)
    _handshake(stub)
    yield stub
    channel.close()
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)


def _handshake(stub: pb_grpc.ExecutorStub) -> None:
    stub.InitDevice(
        pb.InitDeviceRequest(max_num_batched_tokens=64, max_num_seqs=4, max_model_len=256, seed=0),
        timeout=120,
    )
    stub.InitializeCache(pb.InitializeCacheRequest(num_blocks=16), timeout=300)


def test_new_stream_replaces_the_open_one(bare_executor):
    first = GrpcStepStream(bare_executor)
    assert first.step().step_id == 1
    second = GrpcStepStream(bare_executor)
    assert second.step().step_id == 1
    with pytest.raises(grpc.RpcError) as exc:
        first.step()
    assert exc.value.code() == grpc.StatusCode.ABORTED
    assert "replaced by a newer step stream" in exc.value.details()
    assert second.step().step_id == 2  # the newer stream goes on
    second.close()
    first.close()


def test_new_session_ends_the_open_stream(bare_executor):
    stream = GrpcStepStream(bare_executor)
    assert stream.step().step_id == 1
    _handshake(bare_executor)  # another controller's session
    with pytest.raises(grpc.RpcError) as exc:
        stream.step()
    assert exc.value.code() == grpc.StatusCode.ABORTED
    assert "newer controller session" in exc.value.details()
    fresh = GrpcStepStream(bare_executor)
    assert fresh.step().step_id == 1
    fresh.close()
    stream.close()
