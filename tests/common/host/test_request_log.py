"""What the servicer logs about single requests: arrival and end at DEBUG, a request failing
alone at WARNING, each with the request id its sequence id derives from."""

from __future__ import annotations

import logging

import pytest

from common.host.lease import SessionLease
from common.host.servicer import ExecutorServicer
from common.host.settings import ExecutorConfig
from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput
from executor_sim.latency import LatencyModel
from executor_sim.worker import SimOptions, SimWorker

LOGGER = "common.host.request_log"


def _new(rid: str, prompt: list[int], output: list[int] = ()) -> NewRequestData:
    tokens = len(prompt) + len(output)
    return NewRequestData(rid, prompt, list(output), SamplingParams(), [1, 2, 3], 0, tokens)


@pytest.fixture
def servicer(default_model_dir) -> ExecutorServicer:
    options = SimOptions(latency=LatencyModel(fixed_s=0.0, per_token_s=0.0), num_blocks=64)
    worker = SimWorker(ExecutorConfig(model=default_model_dir), options)
    s = ExecutorServicer(worker, lease=SessionLease(start=0))  # session 0, as the steps say
    s.load()
    worker.initialize_cache(64)
    return s


def _lines(caplog) -> list[tuple[str, str | None, str]]:
    return [
        (r.levelname, getattr(r, "request_id", None), r.getMessage())
        for r in caplog.records
        if r.name == LOGGER
    ]


def test_arrival_failure_and_end(servicer, caplog):
    caplog.set_level(logging.DEBUG, LOGGER)
    step = StepInput(
        1,
        new_requests=[
            _new("req-a-0-0", [1, 2, 3]),
            _new("req-b~3-0-1", [10**9]),  # outside the vocabulary: fails alone
            _new("old-0-0", [4, 5], output=[6]),  # resumed after a move
        ],
    )
    out = servicer._execute(step, 0, 0)
    assert [o.error != "" for o in out.outputs] == [False, True, False]
    servicer._execute(
        StepInput(2, cached_requests=[CachedRequestData("req-a-0-0", [], 3, 1)]), 0, 0
    )
    servicer._execute(StepInput(3, finished_request_ids=["req-a-0-0", "old-0-0"]), 0, 0)
    lines = _lines(caplog)
    assert [(level, rid) for level, rid, _ in lines] == [
        ("DEBUG", "req-a"),
        ("DEBUG", "req-b"),
        ("DEBUG", "old"),
        ("WARNING", "req-b"),
        ("DEBUG", "req-a"),
        ("DEBUG", "old"),
    ]
    messages = [m for _, _, m in lines]
    assert messages[0].startswith("request req-a-0-0 arrives (step 1): 3 prompt tokens")
    assert messages[2].startswith("request old-0-0 resumes (step 1): 2 prompt tokens, 1 output")
    assert messages[3].startswith("request req-b~3-0-1 failed (step 1): token id outside")
    assert messages[4] == "request req-a-0-0 finished (step 3)"


def test_no_debug_lines_at_info(servicer, caplog):
    caplog.set_level(logging.INFO, LOGGER)
    servicer._execute(StepInput(1, new_requests=[_new("q-0-0", [1, 2])]), 0, 0)
    servicer._execute(StepInput(2, finished_request_ids=["q-0-0"]), 0, 0)
    assert _lines(caplog) == []
