"""A device failure is not a request's failure. The servicer, in-process over a simulated
worker with injected faults: a step that fails as a whole fails its requests alone and the
stream goes on; a device error (or too many whole-step failures in a row) marks the device
failed: health is told at once, every later call ends UNAVAILABLE."""

from __future__ import annotations

import grpc
import pytest
import torch

from common.host.device_errors import FatalDeviceError, is_fatal_device_error
from common.host.servicer import ExecutorServicer, _StepAborted
from common.host.settings import ExecutorConfig
from common.torch.runner import TorchModelRunner
from common.wire.config import ModelGeometry
from common.wire.pb import executor_pb2 as pb
from common.wire.step_types import NewRequestData, SamplingParams, StepInput
from executor_sim.options import SimOptions
from executor_sim.worker import SimWorker

POISON = 999  # the prompt token that triggers the injected fault


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED when calling cublasSgemm"),
        RuntimeError("Bad StatusOr access: INTERNAL: failed to execute XLA computation"),
        RuntimeError("RESOURCE_EXHAUSTED: Attempting to allocate 1.5G"),
        type("OutOfMemoryError", (RuntimeError,), {})("allocator"),
        FatalDeviceError("the runner says so"),
    ],
)
def test_device_errors_are_recognized(error):
    assert is_fatal_device_error(error)
    try:  # also behind a wrapper's cause
        raise ValueError("while sampling") from error
    except ValueError as wrapped:
        assert is_fatal_device_error(wrapped)


@pytest.mark.parametrize(
    "error", [ValueError("bad shape"), IndexError("index 7 is out of bounds"), KeyError("r1")]
)
def test_request_and_code_errors_are_not_device_errors(error):
    assert not is_fatal_device_error(error)


class _Context:
    """Stands in for a gRPC servicer context: abort raises."""

    def abort(self, code, details):
        raise _Aborted(code, details)

    def peer(self) -> str:
        return "test"

    def invocation_metadata(self) -> tuple:
        return ()


class _Aborted(Exception):
    def __init__(self, code, details):
        super().__init__(details)
        self.code = code


def _servicer(default_model_dir: str, fault: str) -> tuple[ExecutorServicer, list[str]]:
    options = SimOptions(fault=fault, fault_token_id=POISON, step_fixed_ms=0.0)
    worker = SimWorker(ExecutorConfig(model=default_model_dir), options)
    reported: list[str] = []
    servicer = ExecutorServicer(worker, max_failed_steps=3, on_device_failed=reported.append)
    servicer.InitDevice(pb.InitDeviceRequest(max_num_batched_tokens=64, max_num_seqs=4), _Context())
    servicer.InitializeCache(pb.InitializeCacheRequest(num_blocks=32), _Context())
    return servicer, reported


def _run(servicer: ExecutorServicer, step: StepInput):
    """A step on the servicer's current session and stream."""
    return servicer._execute(step, servicer.lease.generation, servicer._stream)


def _step(step_id: int, *prompts: list[int]) -> StepInput:
    news = [
        NewRequestData(f"s{step_id}r{i}", p, [], SamplingParams(), [i + 1], 0, len(p))
        for i, p in enumerate(prompts)
    ]
    return StepInput(step_id, news)


def test_a_step_failing_as_a_whole_fails_its_requests_and_the_stream_goes_on(default_model_dir):
    servicer, reported = _servicer(default_model_dir, "step")
    out = _run(servicer, _step(1, [1, POISON], [5, 6]))
    assert [(o.request_id, "the step failed" in o.error) for o in out.outputs] == [
        ("s1r0", True),
        ("s1r1", True),
    ]
    assert len(servicer.worker.model_runner.requests) == 0  # their state is not trusted
    out = _run(servicer, _step(2, [5, 6]))  # the next step runs
    assert out.outputs[0].sampled_token_id is not None and not out.outputs[0].error
    assert not reported and servicer.worker.check_health()


def test_whole_step_failures_in_a_row_mean_the_device_failed(default_model_dir):
    servicer, reported = _servicer(default_model_dir, "step")
    for step_id in (1, 2):
        assert all(o.error for o in _run(servicer, _step(step_id, [POISON])).outputs)
    with pytest.raises(_StepAborted) as exc:
        _run(servicer, _step(3, [POISON]))
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "3 steps in a row" in exc.value.details
    assert len(reported) == 1 and not servicer.worker.check_health()


def test_a_device_error_fails_the_device_at_once_and_every_later_call(default_model_dir):
    servicer, reported = _servicer(default_model_dir, "device")
    with pytest.raises(_StepAborted) as exc:
        _run(servicer, _step(1, [5, 6], [1, POISON]))
    assert exc.value.code == grpc.StatusCode.UNAVAILABLE and "CUDA error" in exc.value.details
    assert len(reported) == 1 and "CUDA error" in reported[0]
    with pytest.raises(_StepAborted):  # a good step: the device is gone all the same
        _run(servicer, _step(2, [5, 6]))
    with pytest.raises(_Aborted) as aborted:  # and a new controller session cannot start
        servicer.InitDevice(pb.InitDeviceRequest(), _Context())
    assert aborted.value.code == grpc.StatusCode.UNAVAILABLE
    assert servicer.Identify(pb.IdentifyRequest(), _Context()).incarnation_id  # still says who
    assert len(reported) == 1


class _FailingRunner(TorchModelRunner):
    """A torch runner whose device pass raises what it is given."""

    error: Exception = RuntimeError()

    def run_rows(self, rows):
        raise self.error

    def dummy_run(self, num_tokens, num_reqs):
        pass

    def profile_run(self):
        return 0

    def capture_model(self):
        return 0


def test_the_torch_runner_raises_a_failed_pass_for_the_servicer_to_judge():
    geometry = ModelGeometry("m", "LlamaForCausalLM", 100, 1, 1, 4, 64, [2])
    runner = _FailingRunner(
        ExecutorConfig(model="unused", block_size=4), geometry, torch.device("cpu")
    )
    runner.num_blocks = 16
    runner.input_batch.set_limits(runner.step_limits())
    runner.error = RuntimeError("CUDA error: device-side assert triggered")
    step = _step(1, [1, 2, 3])
    with pytest.raises(RuntimeError) as exc:
        runner.execute_model(step)
    assert is_fatal_device_error(exc.value)
    bad = StepInput(2, [NewRequestData("x", [1, 500], [], SamplingParams(), [1], 0, 2)])
    assert "token id outside" in runner.execute_model(bad).outputs[0].error  # rejected first
