"""Wire conversion of steps and results: domain objects survive protobuf unchanged."""

from __future__ import annotations

from common import convert
from common.pb import executor_pb2 as pb
from common.step_types import (
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
        new_requests=[NewRequestData("a", [1, 2, 3], [4], SamplingParams(temperature=0.5, top_k=3,
                                                                          logprobs=2, seed=9),
                                     [5, 6], 2, 2)],
        cached_requests=[CachedRequestData("b", [], 40, 1), CachedRequestData("c", [8, 9], 63, 1)],
        finished_request_ids=["d", "e"])
    wire = convert.step_to_pb(step).SerializeToString()
    assert convert.step_from_pb(pb.StepRequest.FromString(wire)) == step


def test_result_round_trip():
    lp = TokenLogprobs(5, -0.25, 1, [5, 6], [-0.25, -1.5])
    out = StepOutput(step_id=3, outputs=[
        RequestStepOutput("a", sampled_token_id=0),  # token 0 is a token, not "none"
        RequestStepOutput("b", sampled_token_id=12, logprobs=lp, prompt_logprobs=[lp, lp]),
        RequestStepOutput("c"),  # a partial prefill: nothing sampled
        RequestStepOutput("d", error="non-finite values in the forward"),
    ], device_seconds=0.5)
    wire = convert.result_to_pb(out).SerializeToString()
    assert convert.result_from_pb(pb.StepResult.FromString(wire)) == out
