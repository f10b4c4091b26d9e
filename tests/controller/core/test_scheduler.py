"""Unit tests of the step scheduler, driven by a fake executor (no model)."""

from __future__ import annotations

import random

import pytest

from common.wire.step_types import (
    RequestStepOutput,
    StepOutput,
    TokenLogprobs,
)
from controller.core.request import RequestStatus
from controller.core.scheduler import (
    Scheduler,
    SchedulerBase,
    SchedulerConfig,
    load_scheduler_class,
)
from tests.controller.core.harness import (
    EOS,
    FakeExecutor,
    Result,
    drive,
    expected_output,
    make_config,
    make_request,
    run_step,
)

# -- budget, chunking, decode ------------------------------------------------------------------


def test_token_budget_and_chunked_prefill() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=64))
    sched.add_request(make_request("long", 150, max_tokens=3))
    ex, results = FakeExecutor(), {}
    chunks = []
    for _ in range(2):
        chunks.append(run_step(sched, ex, results).num_scheduled_tokens)
        assert "long" not in results  # no token before the prompt is complete
    chunks.append(run_step(sched, ex, results).num_scheduled_tokens)
    assert len(results["long"].tokens) == 1  # the last chunk samples the first token
    chunks += [run_step(sched, ex, results).num_scheduled_tokens for _ in range(2)]
    assert chunks == [64, 64, 22, 1, 1]
    assert results["long"].reason == "length"
    assert results["long"].tokens == expected_output(make_request("long", 150).prompt_token_ids, 3)
    assert results["long"].updates[0].new_token_ids  # first update comes with the first token


def test_lowered_token_budget_chunks_steps_and_unchunked_prompts_ignore_it() -> None:
    """The engine may lower `token_budget` (a step-time target): steps follow it; an executor
    without chunked prefill keeps the whole budget (its prompts must fit one step)."""
    sched = Scheduler(make_config(max_num_batched_tokens=64))
    sched.add_request(make_request("long", 150, max_tokens=2))
    ex, results = FakeExecutor(), {}
    sched.token_budget = 40
    chunks = [run_step(sched, ex, results).num_scheduled_tokens for _ in range(3)]
    sched.token_budget = 500  # never above the configured budget
    chunks += [run_step(sched, ex, results).num_scheduled_tokens for _ in range(2)]
    assert chunks == [40, 40, 40, 30, 1]
    assert results["long"].tokens == expected_output(make_request("long", 150).prompt_token_ids, 2)

    whole = Scheduler(make_config(max_num_batched_tokens=64, chunked_prefill=False))
    whole.add_request(make_request("r", 60))
    whole.token_budget = 16
    assert run_step(whole, FakeExecutor(), {}).num_scheduled_tokens == 60


def test_first_step_shapes_new_then_cached() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=32))
    sched.add_request(make_request("a", 40))
    ex, results = FakeExecutor(), {}
    step1 = run_step(sched, ex, results)
    assert step1.step_id == 1 and len(step1.new_requests) == 1 and not step1.cached_requests
    new = step1.new_requests[0]
    assert (new.num_computed_tokens, new.num_scheduled_tokens, new.block_ids) == (0, 32, [1, 2])
    step2 = run_step(sched, ex, results)
    assert step2.step_id == 2 and not step2.new_requests
    cached = step2.cached_requests[0]
    assert (cached.num_computed_tokens, cached.num_scheduled_tokens, cached.new_block_ids) == (
        32,
        8,
        [3],
    )


def test_long_prefill_threshold_and_sharing_the_budget() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=100, long_prefill_token_threshold=30))
    for rid in "abcd":
        sched.add_request(make_request(rid, 70))
    ex, results = FakeExecutor(), {}
    step = run_step(sched, ex, results)
    assert [r.num_scheduled_tokens for r in step.new_requests] == [30, 30, 30, 10]
    drive(sched, ex)


def test_max_num_seqs_and_decode_one_token_each() -> None:
    sched = Scheduler(make_config(max_num_seqs=3))
    for i in range(5):
        sched.add_request(make_request(f"r{i}", 20, max_tokens=5))
    ex, results = FakeExecutor(), {}
    step = run_step(sched, ex, results)
    assert len(step.new_requests) == 3 and sched.num_running == 3 and sched.num_waiting == 2
    step = run_step(sched, ex, results)
    assert [r.num_scheduled_tokens for r in step.cached_requests] == [1, 1, 1]
    assert not step.new_requests
    drive(sched, ex, results)
    for i in range(5):
        prompt = make_request(f"r{i}", 20).prompt_token_ids
        assert results[f"r{i}"].tokens == expected_output(prompt, 5)
        assert results[f"r{i}"].reason == "length"


def test_chunked_prefill_off_never_splits() -> None:
    sched = Scheduler(
        make_config(
            max_num_batched_tokens=64, chunked_prefill=False, long_prefill_token_threshold=8
        )
    )
    with pytest.raises(ValueError):
        sched.add_request(make_request("huge", 65))
    for i, n in enumerate([40, 30, 64, 10]):
        sched.add_request(make_request(f"r{i}", n))
    ex, results = FakeExecutor(), {}
    seen = []
    while sched.has_unfinished_requests():
        step = run_step(sched, ex, results)
        for new in step.new_requests:
            assert new.num_computed_tokens + new.num_scheduled_tokens == len(new.prompt_token_ids)
            seen.append(new.request_id)
    assert seen == ["r0", "r1", "r2", "r3"]
    assert sched.kv.num_used_blocks == 0


# -- prefix caching ----------------------------------------------------------------------------


def test_prefix_hit_shares_blocks() -> None:
    prefix = list(range(100, 148))  # 3 full blocks
    sched = Scheduler(make_config())
    sched.add_request(make_request("a", prefix + [1, 2, 3], max_tokens=3))
    sched.add_request(make_request("b", prefix + [4, 5], max_tokens=3))
    ex, results = FakeExecutor(), {}
    step = run_step(sched, ex, results)
    a, b = step.new_requests
    assert a.num_computed_tokens == 0 and b.num_computed_tokens == 48
    assert b.num_scheduled_tokens == 2 and a.block_ids[:3] == b.block_ids[:3]
    for block_id in b.block_ids[:3]:
        assert sched.kv.pool.blocks[block_id].ref_count == 2
    assert sched.get_request("b").num_cached_tokens == 48
    stats = sched.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (51 + 50, 48)
    drive(sched, ex, results)
    assert results["b"].tokens == expected_output(prefix + [4, 5], 3)
    # A later request hits the freed, still cached blocks.
    sched.add_request(make_request("c", prefix + [9], max_tokens=1))
    step = run_step(sched, ex, results)
    assert step.new_requests[0].num_computed_tokens == 48
    drive(sched, ex)


def test_prefix_of_exactly_full_blocks_keeps_last_token() -> None:
    prompt = list(range(200, 232))  # exactly 2 blocks
    sched = Scheduler(make_config())
    ex, results = FakeExecutor(), {}
    sched.add_request(make_request("a", prompt, max_tokens=1))
    drive(sched, ex)
    sched.add_request(make_request("b", prompt, max_tokens=2))
    step = run_step(sched, ex, results)
    assert (step.new_requests[0].num_computed_tokens, step.num_scheduled_tokens) == (16, 16)
    drive(sched, ex, results)
    assert results["b"].tokens == expected_output(prompt, 2)


def test_prefix_caching_disabled() -> None:
    prompt = list(range(200, 250))
    sched = Scheduler(make_config(enable_prefix_caching=False))
    ex = FakeExecutor()
    sched.add_request(make_request("a", prompt, max_tokens=1))
    drive(sched, ex)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    assert sched.schedule().new_requests[0].num_computed_tokens == 0
    assert sched.stats().prefix_cache_queries == 0


# -- preemption --------------------------------------------------------------------------------


def test_preemption_by_recompute_fcfs() -> None:
    # 6 usable blocks; two requests of 2 blocks' prompt each grow until they no longer fit.
    sched = Scheduler(make_config(num_blocks=7, enable_prefix_caching=False))
    pa, pb = list(range(10, 40)), list(range(40, 70))
    sched.add_request(make_request("a", pa, max_tokens=40))
    sched.add_request(make_request("b", pb, max_tokens=40))
    ex, results = FakeExecutor(), {}
    preempted_step = None
    while sched.has_unfinished_requests():
        step = run_step(sched, ex, results)
        if "b" in step.finished_request_ids and preempted_step is None:
            preempted_step = step
            assert sched.get_request("b").status is RequestStatus.PREEMPTED
            assert sched.kv.get_block_ids("b") == []
            assert sched.stats().num_preemptions == 1
            assert [r.request_id for r in step.cached_requests] == ["a"]  # b was the victim
            assert not step.new_requests  # nothing admitted in a preempting step
        elif preempted_step is not None and step.new_requests:
            new = step.new_requests[0]
            if new.request_id == "b" and new.output_token_ids:
                assert new.output_token_ids == results["b"].tokens[:-1]  # + this step's
                assert new.num_computed_tokens == 0
    assert preempted_step is not None
    assert results["a"].tokens == expected_output(pa, 40)
    assert results["b"].tokens == expected_output(pb, 40)
    assert sched.kv.num_used_blocks == 0


def test_preemption_resume_uses_prefix_cache() -> None:
    sched = Scheduler(make_config(num_blocks=7))
    pa, pb = list(range(10, 40)), list(range(40, 70))
    sched.add_request(make_request("a", pa, max_tokens=40))
    sched.add_request(make_request("b", pb, max_tokens=40))
    ex = FakeExecutor()
    results = drive(sched, ex)
    assert sched.stats().num_preemptions >= 1
    assert results["a"].tokens == expected_output(pa, 40)
    assert results["b"].tokens == expected_output(pb, 40)


def test_priority_policy_admission_and_victim() -> None:
    sched = Scheduler(
        make_config(
            policy="priority", num_blocks=9, max_num_batched_tokens=256, enable_prefix_caching=False
        )
    )
    sched.add_request(make_request("low", 30, max_tokens=30, priority=5, arrival_time=1.0))
    sched.add_request(make_request("high", 30, max_tokens=30, priority=0, arrival_time=2.0))
    sched.add_request(make_request("mid_late", 30, max_tokens=30, priority=1, arrival_time=4.0))
    sched.add_request(make_request("mid", 30, max_tokens=30, priority=1, arrival_time=3.0))
    ex, results = FakeExecutor(), {}
    step = run_step(sched, ex, results)
    # 8 usable blocks, 2 per prompt: all four fit, admitted by (priority, arrival).
    assert [r.request_id for r in step.new_requests] == ["high", "mid", "mid_late", "low"]
    victims = []
    while sched.has_unfinished_requests():
        step = run_step(sched, ex, results)
        victims += [
            rid
            for rid in step.finished_request_ids
            if rid not in results or results[rid].reason is None
        ]
    assert victims[0] == "low"  # largest priority value goes first
    assert victims[:2] == ["low", "mid_late"] or victims.count("low") >= 2
    assert "high" not in victims
    for rid in ("low", "high", "mid", "mid_late"):
        prompt = make_request(rid, 30).prompt_token_ids
        assert results[rid].tokens == expected_output(prompt, 30)


def test_priority_victim_is_itself_and_the_others_continue() -> None:
    sched = Scheduler(make_config(policy="priority", num_blocks=5, enable_prefix_caching=False))
    sched.add_request(make_request("low", 30, max_tokens=20, priority=9))
    ex, results = FakeExecutor(), {}
    run_step(sched, ex, results)  # low: 2 blocks
    sched.add_request(make_request("high", 30, max_tokens=20, priority=0))
    run_step(sched, ex, results)  # high admitted: 2 blocks, the pool is full
    assert sched.kv.num_free_blocks == 0
    for _ in range(5):
        step = run_step(sched, ex, results)
        if step.finished_request_ids:  # low needs a 3rd block and is the least important
            assert step.finished_request_ids == ["low"]
            assert [r.request_id for r in step.cached_requests] == ["high"]
            break
    else:
        raise AssertionError("no preemption")
    drive(sched, ex, results)
    assert results["high"].tokens == expected_output(make_request("high", 30).prompt_token_ids, 20)
    assert results["low"].tokens == expected_output(make_request("low", 30).prompt_token_ids, 20)


def test_victim_scheduled_earlier_in_the_step_is_taken_back() -> None:
    sched = Scheduler(make_config(policy="priority", num_blocks=6, enable_prefix_caching=False))
    ex, results = FakeExecutor(), {}
    sched.add_request(make_request("low", 20, max_tokens=20, priority=9, arrival_time=0.0))
    sched.add_request(make_request("high", 46, max_tokens=20, priority=0, arrival_time=1.0))
    step = run_step(sched, ex, results)
    assert [r.request_id for r in step.new_requests] == ["high", "low"]  # 5 blocks: pool full
    sched.running.reverse()  # low now runs first and is scheduled before high needs a block
    for _ in range(5):
        step = run_step(sched, ex, results)
        if step.finished_request_ids:
            assert step.finished_request_ids == ["low"]
            assert [r.request_id for r in step.cached_requests] == ["high"]
            assert step.num_scheduled_tokens == 1  # low's token was given back
            break
    else:
        raise AssertionError("no preemption")
    drive(sched, ex, results)
    assert results["low"].tokens == expected_output(make_request("low", 20).prompt_token_ids, 20)
    assert results["high"].tokens == expected_output(make_request("high", 46).prompt_token_ids, 20)


def test_no_admission_in_a_step_that_preempted() -> None:
    sched = Scheduler(make_config(policy="priority", num_blocks=6, enable_prefix_caching=False))
    ex, results = FakeExecutor(), {}
    sched.add_request(make_request("a", 32, max_tokens=5, priority=0, arrival_time=0.0))
    sched.add_request(make_request("b", 40, max_tokens=5, priority=5, arrival_time=1.0))
    run_step(sched, ex, results)  # 5 blocks: the pool is full
    sched.add_request(make_request("c", 10, max_tokens=5, priority=0, arrival_time=2.0))
    step = run_step(sched, ex, results)  # a needs a 3rd block: b is preempted, 2 blocks free
    assert step.finished_request_ids == ["b"] and not step.new_requests
    step = run_step(sched, ex, results)
    assert [r.request_id for r in step.new_requests] == ["c"]  # before b: better priority
    drive(sched, ex, results)
    assert results["b"].tokens == expected_output(make_request("b", 40).prompt_token_ids, 5)


def test_sequences_are_capped_to_what_the_executor_holds() -> None:
    sched = Scheduler(make_config(num_blocks=4))  # 3 usable blocks = 48 tokens
    with pytest.raises(ValueError):
        sched.add_request(make_request("big", 49))
    sched.add_request(make_request("grows", 40, max_tokens=50))
    sched.add_request(make_request("own", 10, max_tokens=50, max_model_len=20))
    results = drive(sched, FakeExecutor())
    assert len(results["grows"].tokens) == 8 and results["grows"].reason == "length"
    assert len(results["own"].tokens) == 10 and results["own"].reason == "length"

    # Without chunked prefill a preempted request must be recomputable in one step.
    sched = Scheduler(make_config(chunked_prefill=False, max_num_batched_tokens=32))
    sched.add_request(make_request("r", 30, max_tokens=50))
    assert sched.get_request("r").max_model_len == 32
    results = drive(sched, FakeExecutor())
    assert len(results["r"].tokens) == 2 and results["r"].reason == "length"


# -- stopping ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kw, script, want_tokens, want_reason",
    [
        ({}, [5, EOS, 7], [5, EOS], "stop"),
        ({"ignore_eos": True}, [5, EOS, 7, 8], [5, EOS, 7, 8], "length"),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 9], [EOS, EOS, EOS], "stop"),
        ({"stop_token_ids": [7]}, [5, 7, 8], [5, 7], "stop"),
        ({"stop_token_ids": [7], "ignore_eos": True}, [EOS, 7], [EOS, 7], "stop"),
        ({"max_model_len": 13}, [5, 6, 7, 8], [5, 6, 7], "length"),
        ({}, [5, 6, 7, EOS, 9], [5, 6, 7, EOS], "stop"),  # stop wins on the last token
    ],
)
def test_finish_reasons(kw, script, want_tokens, want_reason) -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("r", 10, max_tokens=4, eos_token_ids=[EOS], **kw))
    results = drive(sched, FakeExecutor(script={"r": script}))
    assert results["r"].tokens == want_tokens and results["r"].reason == want_reason


def test_config_max_model_len_applies_and_validates() -> None:
    sched = Scheduler(make_config(max_model_len=12))
    with pytest.raises(ValueError):
        sched.add_request(make_request("long", 13))
    sched.add_request(make_request("r", 10, max_tokens=100))
    results = drive(sched, FakeExecutor())
    assert len(results["r"].tokens) == 2 and results["r"].reason == "length"


def test_logprobs_and_prompt_logprobs_pass_through() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=8))
    sched.add_request(make_request("r", 12, max_tokens=1))
    step = sched.schedule()
    plp = [TokenLogprobs(1, -0.5, 1)]
    updates = sched.update_from_output(
        step, StepOutput(1, [RequestStepOutput("r", None, None, plp)])
    )
    assert updates[0].prompt_logprobs == plp and updates[0].new_token_ids == []
    step = sched.schedule()
    lp = TokenLogprobs(42, -0.1, 1, [42], [-0.1])
    updates = sched.update_from_output(step, StepOutput(2, [RequestStepOutput("r", 42, lp)]))
    assert updates[0].new_token_ids == [42] and updates[0].logprobs == [lp]
    assert updates[0].finished and updates[0].finish_reason == "length"


# -- aborts and errors -------------------------------------------------------------------------


def test_abort_mid_prefill_and_mid_decode() -> None:
    sched = Scheduler(make_config(max_num_batched_tokens=32))
    sched.add_request(make_request("pre", 100))
    ex, results = FakeExecutor(), {}
    run_step(sched, ex, results)
    sched.finish_requests(["pre"], "abort")
    assert sched.kv.num_used_blocks == 0 and sched.get_request("pre") is None
    assert not sched.has_unfinished_requests()
    step = run_step(sched, ex, results)
    assert step.num_requests == 0 and not step.finished_request_ids  # kept for the next one

    sched.add_request(make_request("dec", 20, max_tokens=10))
    sched.add_request(make_request("keep", 20, max_tokens=3))
    step = run_step(sched, ex, results)
    assert step.finished_request_ids == ["pre"] and step.step_id == 2
    run_step(sched, ex, results)
    sched.finish_requests(["dec", "unknown"], "abort")
    step = run_step(sched, ex, results)
    assert step.finished_request_ids == ["dec"]
    assert [r.request_id for r in step.cached_requests] == ["keep"]
    drive(sched, ex, results)
    assert len(results["dec"].tokens) == 2 and results["dec"].reason is None


def test_outputs_after_abort_are_ignored() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("a", 20))
    sched.add_request(make_request("b", 20))
    ex = FakeExecutor()
    step = sched.schedule()
    output = ex.run(step)  # the step was in flight ...
    sched.finish_requests(["a"], "stop")  # ... when a stop string ended "a"
    updates = sched.update_from_output(step, output)
    assert [u.request_id for u in updates] == ["b"]
    sched.finish_requests(["b"], "abort")
    assert sched.kv.num_used_blocks == 0
    sched.add_request(make_request("c", 20))
    assert sched.schedule().finished_request_ids == ["a", "b"]


def test_abort_waiting_and_preempted_requests() -> None:
    sched = Scheduler(make_config(max_num_seqs=1))
    sched.add_request(make_request("run", 20, max_tokens=2))
    sched.add_request(make_request("wait", 20))
    ex, results = FakeExecutor(), {}
    run_step(sched, ex, results)
    sched.finish_requests(["wait"], "abort")
    assert sched.num_waiting == 0  # never reached the executor: no id to send
    drive(sched, ex, results)
    assert "wait" not in results and results["run"].reason == "length"


def test_device_error_finishes_only_that_request() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("bad", 40, max_tokens=3))
    sched.add_request(make_request("good", 40, max_tokens=3))
    ex = FakeExecutor()
    ex.fail.add("bad")
    results = drive(sched, ex)
    assert results["bad"].reason == "error" and results["bad"].updates[-1].error == "device says no"
    assert results["good"].tokens == expected_output(make_request("good", 40).prompt_token_ids, 3)
    # The failed request's blocks were cached for a step that never counted: not reusable.
    sched.add_request(make_request("bad", 40, max_tokens=1))
    assert sched.schedule().new_requests[0].num_computed_tokens == 0


def test_add_request_validation_and_loader() -> None:
    sched = Scheduler(make_config())
    sched.add_request(make_request("x", 4))
    for bad in (make_request("x", 4), make_request("e", []), make_request("z", 4, max_tokens=0)):
        with pytest.raises(ValueError):
            sched.add_request(bad)
    with pytest.raises(ValueError):
        sched.finish_requests(["x"], "bored")
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig())  # num_blocks not set
    with pytest.raises(ValueError):
        Scheduler(make_config(policy="random"))
    assert load_scheduler_class("controller.core.scheduler:Scheduler") is Scheduler
    for spec in (
        "controller.core.scheduler",
        "no.such.module:X",
        "controller.core.request:Request",
        "controller.core.scheduler:Nope",
    ):
        with pytest.raises((ValueError, TypeError)):
            load_scheduler_class(spec)
    assert issubclass(Scheduler, SchedulerBase)


# -- stress ------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("seed", range(5))
def test_randomized_stress(policy: str, seed: int) -> None:
    rng = random.Random(seed)
    chunked = seed != 4
    sched = Scheduler(
        make_config(
            policy=policy,
            num_blocks=rng.choice([9, 12, 20]),
            max_num_batched_tokens=rng.choice([24, 64]) if chunked else 128,
            max_num_seqs=rng.choice([3, 8]),
            long_prefill_token_threshold=rng.choice([0, 20]),
            chunked_prefill=chunked,
        )
    )
    ex, results = FakeExecutor(), {}
    prefixes = [[rng.randrange(10, 900) for _ in range(rng.choice([16, 40]))] for _ in range(3)]
    prompts: dict[str, list[int]] = {}
    max_tokens: dict[str, int] = {}
    aborted: set[str] = set()
    for i in range(400):
        if i < 300 and rng.random() < 0.3:
            rid = f"r{i}"
            prompt = rng.choice(prefixes)[: rng.randrange(1, 41)] + [
                rng.randrange(10, 900) for _ in range(rng.randrange(0, 30))
            ]
            prompts[rid], max_tokens[rid] = prompt, rng.randrange(1, 30)
            sched.add_request(make_request(rid, prompt, max_tokens[rid], priority=rng.randrange(3)))
        if rng.random() < 0.05 and sched.requests:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_requests([victim], "abort")
            aborted.add(victim)
        if sched.has_unfinished_requests():
            run_step(sched, ex, results)
    drive(sched, ex, results)
    assert sched.kv.num_used_blocks == 0
    assert sched.stats().prefix_cache_hits <= sched.stats().prefix_cache_queries
    done = 0
    for rid, prompt in prompts.items():
        res = results.get(rid, Result())
        want = expected_output(prompt, max_tokens[rid])
        if rid in aborted:
            assert res.tokens == want[: len(res.tokens)]
        else:
            assert res.reason == "length" and res.tokens == want, rid
            done += 1
    assert done > 10
