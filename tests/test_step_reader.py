"""The servicer's step reader: steps decoded ahead on a thread, in order, errors surfaced."""

from __future__ import annotations

import threading

import pytest

from common import convert
from common.servicer import _decoded_ahead
from common.step_types import StepInput


def _requests(n: int, fail_after: int | None = None, gate: threading.Event | None = None):
    for i in range(n):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("stream cancelled")
        if gate is not None and i == 1:
            gate.wait(5)  # the second step arrives only once the first is running
        yield convert.step_to_pb(StepInput(step_id=i))


def test_steps_come_in_order_and_are_decoded_ahead():
    gate = threading.Event()
    steps = _decoded_ahead(_requests(4, gate=gate))
    first = next(steps)
    assert first.step_id == 0
    gate.set()  # while step 0 "runs", the reader decodes the rest
    assert [s.step_id for s in steps] == [1, 2, 3]


def test_a_broken_stream_raises_after_the_steps_before_it():
    steps = _decoded_ahead(_requests(5, fail_after=2))
    assert next(steps).step_id == 0 and next(steps).step_id == 1
    with pytest.raises(RuntimeError, match="stream cancelled"):
        next(steps)
