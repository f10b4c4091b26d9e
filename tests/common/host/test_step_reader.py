"""The servicer's step reader and step runner: steps decoded ahead and run ahead of their
results' sending, each on a thread, in order, errors surfaced."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.host.servicer import _StepAborted
from common.host.step_pipeline import StepsAhead, decoded_ahead, run_ahead, run_overlapped
from common.wire import convert
from common.wire.step_types import StepInput, StepOutput


def _requests(n: int, fail_after: int | None = None, gate: threading.Event | None = None):
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("stream cancelled")
        if gate is not None and i == 1:
            gate.wait(5)  # the second step arrives only once the first is running
        yield convert.step_to_pb(StepInput(step_id=i))


def test_steps_come_in_order_and_aredecoded_ahead():
    gate = threading.Event()
    steps = decoded_ahead(_requests(4, gate=gate))
    first = next(steps)
    assert first.step_id == 0
    gate.set()  # while step 0 "runs", the reader decodes the rest
    assert [s.step_id for s in steps] == [1, 2, 3]


def test_a_broken_stream_raises_after_the_steps_before_it():
    steps = decoded_ahead(_requests(5, fail_after=2))
    assert next(steps).step_id == 0 and next(steps).step_id == 1
    with pytest.raises(RuntimeError, match="stream cancelled"):
        next(steps)


def _outputs(started: list[int], fail_at: int | None = None):
    def execute(step: StepInput) -> StepOutput:
        started.append(step.step_id)
        if step.step_id == fail_at:
            raise _StepAborted(grpc.StatusCode.INTERNAL, "device fault")
        return StepOutput(step_id=step.step_id, outputs=[])

    return execute


def test_the_next_step_runs_while_a_result_is_being_sent():
    started: list[int] = []
    outputs = run_ahead(iter([StepInput(step_id=i) for i in range(3)]), _outputs(started))
    assert next(outputs).step_id == 0
    deadline = time.monotonic() + 5
    while len(started) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)  # result 0 not yet consumed further: steps 1 and 2 run meanwhile
    assert started == [0, 1, 2]
    assert [o.step_id for o in outputs] == [1, 2]


def test_a_failed_step_raises_after_the_results_before_it():
    started: list[int] = []
    outputs = run_ahead(iter([StepInput(step_id=i) for i in range(5)]), _outputs(started, 1))
    assert next(outputs).step_id == 0
    with pytest.raises(_StepAborted, match="device fault"):
        next(outputs)
    assert started == [0, 1]  # nothing runs after the failed step


def test_no_step_starts_after_the_stream_ends():
    started: list[int] = []
    gate = threading.Event()

    def steps():
        yield StepInput(step_id=0)
        gate.wait(5)
        yield StepInput(step_id=1)

    outputs = run_ahead(steps(), _outputs(started))
    assert next(outputs).step_id == 0
    threading.Timer(0.1, gate.set).start()
    outputs.close()  # the stream's thread is gone (e.g. the call was cancelled)
    assert started == [0]


class _Halves:
    """launch / finish that record their calls; step ``fail_launch`` raises at its launch."""

    def __init__(self, fail_launch: int | None = None, needs_results: tuple[int, ...] = ()):
        self.calls: list[str] = []
        self.fail_launch = fail_launch
        self.needs_results = needs_results
        self.device_done = threading.Event()  # the device work of the steps in flight
        self.device_done.set()

    def launch(self, step: StepInput) -> int:
        self.calls.append(f"launch {step.step_id}")
        if step.step_id == self.fail_launch:
            raise _StepAborted(grpc.StatusCode.INTERNAL, "launch failed")
        return step.step_id

    def finish(self, handle: int) -> StepOutput:
        self.calls.append(f"finish {handle}")
        return StepOutput(step_id=handle, outputs=[])

    def finish_first(self, step: StepInput) -> bool:
        return step.step_id in self.needs_results

    def done(self, handle: int) -> bool:
        return self.device_done.is_set()

    def run(self, steps: StepsAhead):
        return run_overlapped(steps, self.launch, self.finish, self.finish_first, self.done)


def test_each_step_is_launched_before_the_one_in_flight_is_finished():
    halves = _Halves()
    outputs = halves.run(StepsAhead(_requests(3)))
    time.sleep(0.2)  # every step has arrived before the first launch is done
    assert [o.step_id for o in outputs] == [0, 1, 2]
    assert halves.calls in (
        ["launch 0", "launch 1", "finish 0", "launch 2", "finish 1", "finish 2"],
        # the reader may not have step 1 yet when step 0 is launched
        ["launch 0", "finish 0", "launch 1", "launch 2", "finish 1", "finish 2"],
    )


def test_a_step_in_flight_is_finished_when_no_next_step_has_arrived():
    gate = threading.Event()
    halves = _Halves()
    outputs = halves.run(StepsAhead(_requests(3, gate=gate)))
    # Step 1 arrives only after step 0's result is out: step 0 must not wait for it.
    assert next(outputs).step_id == 0
    assert halves.calls == ["launch 0", "finish 0"]
    gate.set()
    assert [o.step_id for o in outputs] == [1, 2]
    assert halves.calls[2:] == ["launch 1", "launch 2", "finish 1", "finish 2"]


def test_a_step_arriving_before_the_one_in_flight_is_done_is_launched_first():
    gate = threading.Event()
    halves = _Halves()
    halves.device_done.clear()  # step 0's device work goes on until step 1 has arrived
    outputs = halves.run(StepsAhead(_requests(2, gate=gate)))
    threading.Timer(0.2, gate.set).start()
    threading.Timer(5, halves.device_done.set).start()  # (a failing run still ends)
    assert [o.step_id for o in outputs] == [0, 1]
    assert halves.calls[:3] == ["launch 0", "launch 1", "finish 0"]


def test_a_step_that_needs_the_results_waits_for_them():
    halves = _Halves(needs_results=(2,))
    requests = [convert.step_to_pb(StepInput(step_id=i)) for i in range(3)]
    steps = StepsAhead(iter(requests))
    time.sleep(0.2)
    assert [o.step_id for o in halves.run(steps)] == [0, 1, 2]
    assert halves.calls == ["launch 0", "launch 1", "finish 0", "finish 1", "launch 2", "finish 2"]


def test_a_failed_launch_raises_after_the_output_of_the_step_in_flight():
    halves = _Halves(fail_launch=1)
    steps = StepsAhead(iter([convert.step_to_pb(StepInput(step_id=i)) for i in range(4)]))
    time.sleep(0.2)
    outputs = halves.run(steps)
    assert next(outputs).step_id == 0
    with pytest.raises(_StepAborted, match="launch failed"):
        next(outputs)
    assert halves.calls == ["launch 0", "launch 1", "finish 0"]  # nothing after it


def test_a_broken_stream_raises_after_the_step_in_flight_is_finished():
    halves = _Halves()
    outputs = halves.run(StepsAhead(_requests(5, fail_after=2)))
    assert [next(outputs).step_id for _ in range(2)] == [0, 1]
    with pytest.raises(RuntimeError, match="stream cancelled"):
        next(outputs)
    assert halves.calls.count("finish 1") == 1 and halves.calls[-1] == "finish 1"
