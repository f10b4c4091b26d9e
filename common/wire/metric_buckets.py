"""Histogram buckets the controller's and the executors' metrics share, so that a step's time
as the controller saw it and as the executor measured it land in the same buckets and can be
compared panel by panel."""

from __future__ import annotations

#: Seconds of one step: 1 ms (a fast GPU decode) to 5 s (a long prefill on a CPU).
STEP_SECONDS_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.15,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
)
#: Requests in one step.
STEP_REQUEST_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
