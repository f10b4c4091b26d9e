"""Pipelined steps: the scheduler schedules step N+1 before step N's result is back (tokens in
flight are placeholders the executor fills). Same outputs as one step at a time, no block
leaked, finished and preempted requests handled, against the fake executor of
test_scheduler (which checks every KV position it reads)."""

from __future__ import annotations

from collections import deque

import pytest

from controller.core.scheduler import Scheduler
from tests.controller.core.harness import (
    EOS,
    FakeExecutor,
    Result,
    check_invariants,
    expected_output,
    make_config,
    make_request,
    random_workload,
)


def drive_pipelined(
    sched: Scheduler, ex: FakeExecutor, depth: int, on_step=None, max_steps: int = 5000
) -> dict[str, Result]:
    """Keep up to `depth` steps in flight (the executor runs each as it is sent, as a real one
    does in stream order); apply results in order. `on_step(i, sched)` may abort requests."""
    results: dict[str, Result] = {}
    inflight: deque = deque()
    for i in range(max_steps):
        if on_step is not None:
            on_step(i, sched)
        if len(inflight) < depth and sched.has_unfinished_requests():
            step = sched.schedule()
            check_invariants(sched, step)
            if step.num_requests:
                inflight.append((step, ex.run(step)))
                continue
        if not inflight:
            if not sched.has_unfinished_requests():
                break
            raise AssertionError("nothing in flight and nothing schedulable")
        step, output = inflight.popleft()
        for update in sched.update_from_output(step, output):
            res = results.setdefault(update.request_id, Result())
            assert res.reason is None, "update after finish"
            res.tokens += update.new_token_ids
            res.updates.append(update)
            if update.finished:
                res.reason = update.finish_reason
        check_invariants(sched)
    else:
        raise AssertionError("did not drain")
    assert sched.kv.num_used_blocks == 0
    assert all(r.num_pending_tokens == 0 for r in sched.requests.values())
    assert set(ex.held) == set(sched._finished_ids)
    return results


def _workload(seed: int, sched: Scheduler) -> dict[str, tuple[list[int], int]]:
    return random_workload(sched, seed, count=24, share_every=3, max_extra=70, max_tokens=30)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("num_blocks", [14, 64])
def test_pipelined_outputs_match_one_step_at_a_time(seed, num_blocks):
    outputs = {}
    for depth in (1, 2, 3):
        sched = Scheduler(
            make_config(num_blocks=num_blocks, max_num_batched_tokens=48, max_num_seqs=8)
        )
        made = _workload(seed, sched)
        results = drive_pipelined(sched, FakeExecutor(), depth)
        for rid, (prompt, max_tokens) in made.items():
            assert results[rid].reason == "length"
            assert results[rid].tokens == expected_output(prompt, max_tokens), (depth, rid)
        outputs[depth] = {rid: r.tokens for rid, r in results.items()}
        if num_blocks == 14:
            assert sched.stats().num_preemptions > 0 or seed % 2  # tight pool: preemptions
    assert outputs[1] == outputs[2] == outputs[3]


def test_stop_token_in_flight_wastes_one_step_and_streams_nothing_after():
    sched = Scheduler(make_config())
    req = make_request("s", 20, max_tokens=50, eos_token_ids=[EOS])
    sched.add_request(req)
    ex = FakeExecutor(script={"s": [7, 8, EOS, 9, 10, 11]})
    results = drive_pipelined(sched, ex, depth=2)
    assert results["s"].tokens == [7, 8, EOS] and results["s"].reason == "stop"


def test_max_tokens_is_never_oversampled():
    sched = Scheduler(make_config())
    sched.add_request(make_request("m", 5, max_tokens=3))
    ex = FakeExecutor()
    sampled = []
    original = ex.run

    def run(step):
        out = original(step)
        sampled.extend(o.sampled_token_id for o in out.outputs if o.sampled_token_id)
        return out

    ex.run = run
    results = drive_pipelined(sched, ex, depth=3)
    assert len(results["m"].tokens) == 3 and len(sampled) == 3  # no step past max_tokens


def test_abort_with_steps_in_flight_frees_everything():
    sched = Scheduler(make_config(max_num_batched_tokens=32))
    for i in range(6):
        sched.add_request(make_request(f"a{i}", 30 + i, max_tokens=40))

    def abort(i, s):
        if i in (5, 9):  # a5, a0, a3, a4
            s.finish_requests([f"a{i % 6}", f"a{(i + 1) % 6}"], "abort")

    results = drive_pipelined(sched, FakeExecutor(), depth=2, on_step=abort)
    done = {rid for rid, r in results.items() if r.reason == "length"}
    assert done == {"a1", "a2"}
