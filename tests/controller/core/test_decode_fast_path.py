"""The scheduler's per-step fast paths give the same steps and outputs as the general ones.

- Decode fast path: a request with room in its block table and no block newly full skips
  `allocate_slots` (`Request.kv_room`, `kv_hash_limit`). Turned off, every step, block table
  and cached hash must be the same.
- Packed results (`StepOutput.sampled_token_ids` without per-request messages, what every
  plain decode step receives over the wire) go through `step_results.apply_tokens`: the same
  tokens, finish reasons and freed blocks as the per-request form.
"""

from __future__ import annotations

import pytest

from common.wire.convert import result_from_pb, result_to_pb
from common.wire.step_types import StepInput, StepOutput
from controller.core.kv_cache import KVCacheManager
from controller.core.scheduler import Scheduler
from tests.controller.core.harness import (
    EOS,
    FakeExecutor,
    check_invariants,
    expected_output,
    make_config,
    make_request,
    random_workload,
)
from tests.controller.core.test_pipeline import drive_pipelined


class PackedExecutor(FakeExecutor):
    """The fake executor whose results cross the wire: packed, as an executor sends them."""

    def run(self, step: StepInput) -> StepOutput:
        return result_from_pb(result_to_pb(super().run(step), step))


def _add_workload(sched: Scheduler, seed: int) -> dict[str, tuple[list[int], int]]:
    return random_workload(sched, seed, count=20, share_every=2, max_extra=60, max_tokens=50)


def _no_room(self: KVCacheManager, request, table) -> None:
    request.kv_room = request.kv_hash_limit = 0  # every step through allocate_slots


def _trace(num_blocks: int, prefix: bool, seed: int, fast: bool, monkeypatch) -> list:
    """Every step of a pipelined run, with the block tables and cached hashes after it."""
    with monkeypatch.context() as m:
        if not fast:
            m.setattr(KVCacheManager, "_set_room", _no_room)
        sched = Scheduler(
            make_config(
                num_blocks=num_blocks,
                max_num_batched_tokens=64,
                max_num_seqs=8,
                enable_prefix_caching=prefix,
            )
        )
        made = _add_workload(sched, seed)
        trace: list = []

        def record(_i: int, s: Scheduler) -> None:
            tables = {r.request_id: s.kv.get_block_ids(r.request_id) for r in s.running}
            trace.append((s._step_id, tables, sorted(s.kv.pool.cached)))

        results = drive_pipelined(sched, FakeExecutor(), depth=2, on_step=record)
    for rid, (prompt, max_tokens) in made.items():
        assert results[rid].tokens == expected_output(prompt, max_tokens)
    return trace


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("num_blocks,prefix", [(16, True), (64, True), (64, False)])
def test_decode_fast_path_changes_no_step(seed, num_blocks, prefix, monkeypatch):
    fast = _trace(num_blocks, prefix, seed, True, monkeypatch)
    slow = _trace(num_blocks, prefix, seed, False, monkeypatch)
    assert fast == slow


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("depth", [1, 2])
def test_packed_results_match_per_request_results(seed, depth):
    outputs = []
    for executor in (FakeExecutor, PackedExecutor):
        sched = Scheduler(make_config(num_blocks=20, max_num_batched_tokens=48, max_num_seqs=8))
        made = _add_workload(sched, seed)
        results = drive_pipelined(sched, executor(), depth)
        for rid, (prompt, max_tokens) in made.items():
            assert results[rid].reason == "length"
            assert results[rid].tokens == expected_output(prompt, max_tokens)
        outputs.append({rid: r.tokens for rid, r in results.items()})
    assert outputs[0] == outputs[1]


def test_packed_stop_ids_eos_min_tokens_and_ignore_eos():
    sched = Scheduler(make_config())
    sched.add_request(make_request("eos", 20, max_tokens=50, eos_token_ids=[EOS]))
    sched.add_request(make_request("stop", 20, max_tokens=50, stop_token_ids=[9]))
    sched.add_request(make_request("min", 20, max_tokens=50, eos_token_ids=[EOS], min_tokens=4))
    sched.add_request(make_request("ign", 20, max_tokens=5, eos_token_ids=[EOS], ignore_eos=True))
    script = {
        "eos": [7, 8, EOS, 9],
        "stop": [7, 9, 8],
        "min": [EOS, 7, EOS, 8, EOS, 6],
        "ign": [EOS, EOS, 7, EOS, 8, 9],
    }
    results = drive_pipelined(sched, PackedExecutor(script=script), depth=2)
    assert (results["eos"].tokens, results["eos"].reason) == ([7, 8, EOS], "stop")
    assert (results["stop"].tokens, results["stop"].reason) == ([7, 9], "stop")
    assert (results["min"].tokens, results["min"].reason) == ([EOS, 7, EOS, 8, EOS], "stop")
    assert (results["ign"].tokens, results["ign"].reason) == ([EOS, EOS, 7, EOS, 8], "length")


def test_packed_missing_token_fails_the_request_alone():
    sched = Scheduler(make_config())
    sched.add_request(make_request("a", 20, max_tokens=6))
    sched.add_request(make_request("b", 20, max_tokens=6))
    step = sched.schedule()
    output = FakeExecutor().run(step)
    tokens = [o.sampled_token_id for o in output.outputs]
    tokens[0] = -1  # the executor sampled nothing for the first request
    updates = sched.update_from_output(step, StepOutput(step.step_id, [], 0.0, tokens))
    by_id = {u.request_id: u for u in updates}
    first = step.new_requests[0].request_id
    other = step.new_requests[1].request_id
    assert by_id[first].finished and by_id[first].finish_reason == "error"
    assert by_id[first].error and not by_id[first].new_token_ids
    assert not by_id[other].finished and len(by_id[other].new_token_ids) == 1
    check_invariants(sched)
    assert sched.get_request(first) is None and sched.num_running == 1
