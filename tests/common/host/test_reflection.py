"""gRPC server reflection is opt-in: an executor lists its services only with
--grpc-reflection (health is always served: probes speak it)."""

from __future__ import annotations

import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.processes import spawn_executor, wait_until


def _listed(port: int) -> set[str]:
    """The services reflection lists (raises grpc.RpcError when it is not served)."""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        req = reflection_pb2.ServerReflectionRequest(list_services="")
        return {
            s.name
            for r in stub.ServerReflectionInfo(iter([req]), timeout=5)
            for s in r.list_services_response.service
        }


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
        return status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize("flag", [[], ["--grpc-reflection"]], ids=["default", "opt-in"])
def test_reflection_only_when_asked(default_model_dir, tmp_path, flag):
    proc, port = spawn_executor("executor_sim", default_model_dir, str(tmp_path), "sim", extra=flag)
    try:
        wait_until(lambda: _serving(port), 60, "the simulated executor", logs=str(tmp_path))
        if flag:
            assert {"tandem.executor.v1.Executor", "grpc.health.v1.Health"} <= _listed(port)
        else:
            with pytest.raises(grpc.RpcError) as exc:
                _listed(port)
            assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
