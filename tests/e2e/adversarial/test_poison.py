"""Poison isolation: a request that cannot be converted, or that fails inside an executor,
finishes alone with an error to its client; the session, the executor and every other
request go on. A request moved off lost executors more than the bound fails instead of taking
the next one down. Each test holds the status AND the cost: time to answer, executor losses
(tandem:executor_lost_total), controller RSS, and concurrent requests still answered with
their greedy text."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.adversarial.isolation_support import (
    INNOCENT_PROMPTS,
    InnocentLoad,
    complete,
    controller_rss,
    greedy,
    greedy_texts,
    start_sim_fleet,
)
from tests.e2e.helpers import executors_lost

REJECTED = 7777  # the simulated device fails a request carrying this token, alone
HANG = 7778  # a step bringing this token stalls past the controller's step timeout
RSS_GROWTH_MIB = 64  # the controller's memory allowance for one attack


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory):
    """Two simulated executors that fail requests carrying REJECTED (and only those)."""
    fault = ["--fault", "reject", "--fault-token-id", str(REJECTED)]
    server = start_sim_fleet(default_model_dir, str(tmp_path_factory.mktemp("poison")), [fault] * 2)
    server.references = greedy_texts(server, INNOCENT_PROMPTS)
    yield server
    server.stop()


def _error(body: dict) -> dict:
    assert set(body) == {"error"}, body
    return body["error"]


def test_a_seed_at_the_top_of_int64_touches_nothing_else(fleet):
    """The issue's request: the second choice's seed (seed + 1) overflowed int64 on the wire.
    Before: the step loop failed, the executor was declared lost and the request moved back to
    it, ~90 losses in 30 s, no answer. Now the API derives each choice's seed inside int64
    (seed + j wraps), so it is answered at once, and were a seed still to reach the engine
    unconvertible it would fail alone before any step (the engine's own check, tested in
    tests/controller/fleet/test_poison_isolation.py): nothing else is touched."""
    lost, rss = executors_lost(fleet), controller_rss(fleet)
    body = {"prompt": "hi", "n": 2, "seed": 2**63 - 1, "max_tokens": 2}
    with InnocentLoad(fleet, INNOCENT_PROMPTS[:3], fleet.references[:3]) as load:
        time.sleep(0.5)
        answers = []
        for _ in range(5):  # again and again: the same answer, nothing lost
            status, answer, seconds = complete(fleet, body, timeout=30)
            assert status == 200, answer
            assert seconds < 5.0
            assert [c["index"] for c in answer["choices"]] == [0, 1]
            answers.append([c["text"] for c in answer["choices"]])
        time.sleep(0.5)
    assert all(a == answers[0] for a in answers)  # seeded: the same texts every time
    load.check(at_least=6)
    assert executors_lost(fleet) == lost
    assert controller_rss(fleet) - rss < RSS_GROWTH_MIB
    assert all(e["healthy"] and e["losses"] == 0 for e in fleet.executors_state())


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_request_the_executor_fails_fails_alone(fleet, stream):
    lost = executors_lost(fleet)
    with InnocentLoad(fleet, INNOCENT_PROMPTS, fleet.references) as load:
        time.sleep(0.5)
        started = time.perf_counter()
        resp = httpx.post(
            fleet.base_url + "/v1/completions",
            json={"model": fleet.model_name, **greedy([1, REJECTED, 3], 8), "stream": stream},
            timeout=30,
        )
        seconds = time.perf_counter() - started
        time.sleep(0.5)
    assert seconds < 5.0
    if stream:  # the stream carries the error, then ends cleanly
        assert resp.status_code == 200
        events = [line for line in resp.text.splitlines() if line.startswith("data: ")]
        assert "simulated device error" in resp.text and events[-1] == "data: [DONE]"
    else:
        assert resp.status_code == 500
        error = _error(resp.json())
        assert error["code"] == "generation_failed"
        assert "simulated device error" in error["message"]
    load.check(at_least=6)
    assert executors_lost(fleet) == lost
    state = fleet.wait_idle()
    assert all(e["healthy"] and e["used_blocks"] == 0 for e in state), state


def test_a_request_moved_more_than_the_bound_fails(default_model_dir, tmp_path):
    """An executor that stalls (past --step-timeout) on every step bringing one request: the
    request is moved off it again and again. After --max-request-moves (default 3) moves it
    fails, so the executor is lost 4 times, not forever. A second executor (whose steps are too
    small for that request's prompt) serves the other requests meanwhile, with their greedy
    text."""
    hang = ["--fault", "hang", "--fault-token-id", str(HANG), "--fault-hang-seconds", "2"]
    # Whole prompts only, 64 tokens a step: the poison's 200 never run there.
    small = ["--device-kind", "tpu", "--no-chunked-prefill"]
    server = start_sim_fleet(
        default_model_dir,
        str(tmp_path),
        [hang, small],
        ["--step-timeout", "1", "--executor-limits", "tpu=64,8"],
    )
    try:
        references = greedy_texts(server, INNOCENT_PROMPTS[:3])
        lost = executors_lost(server)
        poison = [HANG] + [11] * 199
        with InnocentLoad(server, INNOCENT_PROMPTS[:3], references) as load:
            status, answer, seconds = complete(server, greedy(poison, 4), timeout=120)
        assert status == 500, answer
        error = _error(answer)
        assert error["code"] == "generation_failed"
        assert "lost 4 times" in error["message"] and "not moved more than 3" in error["message"]
        assert seconds < 60.0
        assert executors_lost(server) - lost == 4  # bounded: the moves, plus the last loss
        load.check(at_least=3)
        wait_healthy = server.wait_idle(60)
        assert all(e["used_blocks"] == 0 for e in wait_healthy), wait_healthy
    finally:
        server.stop()
