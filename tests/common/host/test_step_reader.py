"""The servicer's step reader and step runner: steps decoded ahead and run ahead of their
results' sending, each on a thread, in order, errors surfaced."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from common.host.servicer import _StepAborted
from common.host.step_pipeline import decoded_ahead, run_ahead
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
