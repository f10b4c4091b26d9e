"""Wire conversion of steps and results: domain objects survive protobuf unchanged."""

from __future__ import annotations

from common.wire import convert
from common.wire.pb import executor_pb2 as pb
from common.wire.step_types import (
    CachedRequestData,
    NewRequestData,
    RequestStepOutput,
    SamplingParams,
    StepInput,
    StepOutput,
    TokenLogprobs,
)


def test_step_round_trip():
    step = StepInput(
        step_id=7,
        new_requests=[
            NewRequestData(
                "a",
                [1, 2, 3],
                [4],
                SamplingParams(temperature=0.5, top_k=3, logprobs=2, seed=9),
                [5, 6],
                2,
                2,
            )
        ],
        cached_requests=[CachedRequestData("b", [], 40, 1), CachedRequestData("c", [8, 9], 63, 1)],
        finished_request_ids=["d", "e"],
    )
    wire = convert.step_to_pb(step).SerializeToString()
    assert convert.step_from_pb(pb.StepRequest.FromString(wire)) == step


def test_result_round_trip():
    lp = TokenLogprobs(5, -0.25, 1, [5, 6], [-0.25, -1.5])
    out = StepOutput(
        step_id=3,
        outputs=[
            RequestStepOutput("a", sampled_token_id=0),  # token 0 is a token, not "none"
            RequestStepOutput("b", sampled_token_id=12, logprobs=lp, prompt_logprobs=[lp, lp]),
            RequestStepOutput("c"),  # a partial prefill: nothing sampled
            RequestStepOutput("d", error="non-finite values in the forward"),
        ],
        device_seconds=0.5,
    )
    wire = convert.result_to_pb(out).SerializeToString()
    assert convert.result_from_pb(pb.StepResult.FromString(wire)) == out


def test_packed_result_carries_a_token_per_request_and_messages_only_for_extras():
    lp = TokenLogprobs(5, -0.25, 1, [5, 6], [-0.25, -1.5])
    step = StepInput(
        step_id=3,
        new_requests=[NewRequestData("n", [1, 2], [], SamplingParams(), [1], 0, 2)],
        cached_requests=[CachedRequestData(r, [], 9, 1) for r in "abcd"],
    )
    # An executor's outputs come in its batch order, not the step's.
    outputs = [
        RequestStepOutput("d", error="non-finite values in the forward"),
        RequestStepOutput("b", sampled_token_id=12, logprobs=lp),
        RequestStepOutput("a", sampled_token_id=0),
        RequestStepOutput("n"),  # a partial prefill: nothing sampled
        RequestStepOutput("c", sampled_token_id=7),
    ]
    msg = convert.result_to_pb(StepOutput(3, outputs, 0.5), step)
    assert list(msg.sampled_token_ids) == [-1, 0, 12, 7, -1]
    assert sorted(o.request_id for o in msg.outputs) == ["b", "d"]
    back = convert.result_from_pb(pb.StepResult.FromString(msg.SerializeToString()))
    assert back.sampled_token_ids == [-1, 0, 12, 7, -1] and back.device_seconds == 0.5
    assert {o.request_id: o for o in back.outputs} == {"b": outputs[1], "d": outputs[0]}


def test_the_scheduler_reads_both_result_forms_alike():
    from controller.core.request import Request
    from controller.core.scheduler import Scheduler, SchedulerConfig

    def run(packed: bool) -> list:
        sched = Scheduler(
            SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8, block_size=4, num_blocks=64)
        )
        for rid in "abc":
            sched.add_request(
                Request(
                    rid, [1, 2, 3], SamplingParams(logprobs=0 if rid == "b" else None), max_tokens=3
                )
            )
        seen = []
        for i in range(4):
            step = sched.schedule()
            rids = [r.request_id for r in step.new_requests + step.cached_requests]
            if not rids:
                break
            outs = StepOutput(
                step.step_id,
                [
                    RequestStepOutput(
                        rid,
                        sampled_token_id=10 * i + ord(rid),
                        logprobs=TokenLogprobs(10 * i + ord(rid), -1.0, 1) if rid == "b" else None,
                        error="bad" if (rid, i) == ("c", 2) else "",
                    )
                    for rid in reversed(rids)
                ],
            )
            if packed:
                outs = convert.result_from_pb(convert.result_to_pb(outs, step))
                assert outs.sampled_token_ids is not None
            updates = sched.update_from_output(step, outs)
            seen.append(sorted(updates, key=lambda u: u.request_id))  # order is the form's
        return seen

    assert run(packed=True) == run(packed=False)


def test_requests_that_cannot_go_on_the_wire_are_named_without_echoing_them():
    ok = NewRequestData("ok", [1, 2], [], SamplingParams(seed=2**63 - 1), [1], 0, 2)
    seed = NewRequestData("seed", [1, 2], [], SamplingParams(seed=2**63), [2], 0, 2)
    token = NewRequestData("token", [1, 2**31], [], SamplingParams(), [3], 0, 2)
    name = NewRequestData("\ud800", [1], [], SamplingParams(), [4], 0, 1)
    assert convert.new_request_wire_problem(ok) == ""
    assert "out of range" in convert.new_request_wire_problem(seed)
    step = StepInput(
        1, [ok, seed, token, name], [CachedRequestData("big", [2**40], 0, 1)], ["done"]
    )
    problems = convert.step_wire_problems(step)
    assert set(problems) == {"seed", "token", "\ud800", "big"}
    for text in problems.values():
        text.encode("utf-8")  # never quotes a lone surrogate back
    assert "\\ud800" in problems["\ud800"]


def test_cached_requests_go_packed_unless_one_has_a_mask():
    cached = [
        CachedRequestData("b", [], 40, 1),
        CachedRequestData("c", [8, 9], 63, 1),
        CachedRequestData("d", [], 7, 3),
        CachedRequestData("e", [11], 15, 1),
    ]
    step = StepInput(9, cached_requests=cached, finished_request_ids=["x"])
    msg = convert.step_to_pb(step)
    assert not msg.cached_requests and list(msg.packed_request_ids) == ["b", "c", "d", "e"]
    assert list(msg.packed_num_new_blocks) == [0, 2, 0, 1]
    assert convert.step_from_pb(pb.StepRequest.FromString(msg.SerializeToString())) == step
    decode = StepInput(10, cached_requests=[CachedRequestData(r, [], 9, 1) for r in "ab"])
    msg = convert.step_to_pb(decode)
    assert not msg.packed_num_new_blocks  # no block appended: no counts sent
    assert convert.step_from_pb(msg) == decode
    # A mask needs the message form: then every cached request goes as a message (one order).
    masked = StepInput(11, cached_requests=[cached[0], CachedRequestData("m", [], 3, 1, b"\1")])
    msg = convert.step_to_pb(masked)
    assert not msg.packed_request_ids and len(msg.cached_requests) == 2
    assert convert.step_from_pb(msg) == masked


def test_inconsistent_packed_arrays_never_raise():
    # Missing numbers become -1 (the executor's step check rejects that request alone);
    # missing blocks are cut short.
    msg = pb.StepRequest(
        step_id=1,
        packed_request_ids=["a", "b", "c"],
        packed_num_computed_tokens=[4],
        packed_num_scheduled_tokens=[1, 1],
        packed_num_new_blocks=[1, 5],
        packed_new_block_ids=[3, 4],
    )
    step = convert.step_from_pb(msg)
    assert step.cached_requests == [
        CachedRequestData("a", [3], 4, 1),
        CachedRequestData("b", [4], -1, 1),
        CachedRequestData("c", [], -1, -1),
    ]


def test_packed_steps_only_for_an_executor_that_reads_them():
    from common.wire.config import Capabilities

    step = StepInput(4, cached_requests=[CachedRequestData("a", [3], 9, 1)])
    msg = convert.step_to_pb(step, packed=False)  # an older executor: messages
    assert len(msg.cached_requests) == 1 and not msg.packed_request_ids
    assert convert.step_from_pb(msg) == step
    # This version's executors say so; one that does not set the field (older) reads False.
    assert Capabilities().packed_steps
    assert not convert.device_info_from_pb(pb.InitDeviceResponse()).capabilities.packed_steps
