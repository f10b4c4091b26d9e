"""Faults a simulated executor injects on purpose, for tests of what fails alone and what
takes an executor down.

A request whose prompt carries ``--fault-token-id`` triggers ``--fault`` in the step that
brings it (as a new request):

- ``reject``: the device fails that request alone (its error in the result, its state dropped);
- ``step``: the step raises an error no request explains (the executor fails the step's
  requests and goes on);
- ``hang``: the step takes ``--fault-hang-seconds`` longer (past the controller's step timeout,
  the executor counts as lost);
- ``device``: the device fails (a CUDA error): the executor turns NOT_SERVING, then exits.
"""

from __future__ import annotations

import time
from typing import Literal

from common.wire.step_types import RequestStepOutput, StepInput, StepOutput

FaultKind = Literal["none", "reject", "step", "hang", "device"]


def triggered(step: StepInput, token: int) -> list[str]:
    """The new requests of the step whose prompt carries ``token``."""
    if token < 0:
        return []
    return [r.request_id for r in step.new_requests if token in r.prompt_token_ids]


def before_step(kind: FaultKind, hang_seconds: float) -> None:
    """Inject a fault that happens before (or instead of) the step's work."""
    if kind == "step":
        raise RuntimeError("simulated step failure")
    if kind == "device":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    if kind == "hang":
        time.sleep(hang_seconds)


def reject(output: StepOutput, request_ids: list[str]) -> None:
    """Fail these requests of a finished step alone, as a device that could not run them."""
    bad = set(request_ids)
    output.outputs = [
        RequestStepOutput(o.request_id, error="simulated device error for this request")
        if o.request_id in bad
        else o
        for o in output.outputs
    ]
