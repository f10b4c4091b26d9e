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
from common.wire import convert
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


class _OverlappingSimWorker(SimWorker):
    """A simulated worker whose steps come in two halves, as an overlapping GPU worker's do:
    the step runs (and an injected fault strikes) at its finish, or at its launch when
    ``fail_at_launch``."""

    fail_at_launch = False
    calls: list[str]

    @property
    def overlaps_steps(self) -> bool:
        return True

    def launch_step(self, step: StepInput) -> object:
        self.calls.append(f"launch {step.step_id}")
        return self.execute_model(step) if self.fail_at_launch else step

    def finish_step(self, launched) -> object:
        step_id = launched.step_id
        self.calls.append(f"finish {step_id}")
        return launched if self.fail_at_launch else self.execute_model(launched)

    def step_done(self, launched) -> bool:
        return False  # "the device is busy": a step that has arrived is always launched first


def _overlapped_stream(default_model_dir: str, fault: str, fail_at_launch: bool, steps):
    options = SimOptions(fault=fault, fault_token_id=POISON, step_fixed_ms=0.0)
    worker = _OverlappingSimWorker(ExecutorConfig(model=default_model_dir), options)
    worker.calls, worker.fail_at_launch = [], fail_at_launch
    servicer = ExecutorServicer(worker, max_failed_steps=3)
    servicer.InitDevice(pb.InitDeviceRequest(max_num_batched_tokens=64, max_num_seqs=4), _Context())
    servicer.InitializeCache(pb.InitializeCacheRequest(num_blocks=32), _Context())
    requests = [convert.step_to_pb(s) for s in steps]
    results = []
    try:
        for result in servicer.ExecuteModel(iter(requests), _Context()):
            results.append(result)
    except _Aborted as exc:
        return worker, results, exc
    return worker, results, None


@pytest.mark.parametrize("fail_at_launch", [False, True], ids=["at-finish", "at-launch"])
def test_overlapped_steps_fail_alone_and_in_order(default_model_dir, fail_at_launch):
    steps = [_step(1, [5, 6]), _step(2, [1, POISON]), _step(3, [7, 8])]
    worker, results, aborted = _overlapped_stream(default_model_dir, "step", fail_at_launch, steps)
    assert aborted is None and [r.step_id for r in results] == [1, 2, 3]
    outputs = [convert.result_from_pb(r).outputs for r in results]
    assert not any(o.error for o in outputs[0] + outputs[2])
    assert all("the step failed" in o.error for o in outputs[1])
    if not fail_at_launch:  # each step was launched before the one before it was finished
        assert worker.calls[:3] == ["launch 1", "launch 2", "finish 1"]


def test_an_overlapped_device_error_ends_the_stream_after_the_results_before_it(
    default_model_dir,
):
    steps = [_step(1, [5, 6]), _step(2, [1, POISON]), _step(3, [7, 8])]
    worker, results, aborted = _overlapped_stream(default_model_dir, "device", False, steps)
    assert [r.step_id for r in results] == [1]
    assert aborted is not None and aborted.code == grpc.StatusCode.UNAVAILABLE
    assert worker.calls[:3] == ["launch 1", "launch 2", "finish 1"]
