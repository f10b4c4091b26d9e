"""Generation requests from a body: per-choice seeds inside int64, tiny temperatures greedy,
context limits; and error bodies that always encode."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from common.host.step_check import StepLimits, sampling_problem
from common.wire.convert import sampling_from_pb, sampling_to_pb
from controller.api.building import (
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    BuildOptions,
    choice_seed,
    generation_requests,
    sampling_params,
    token_limit,
)
from controller.api.errors import APIError, error_response, quote
from controller.api.formats import Prompt
from controller.api.protocol import CompletionRequest

INT64_MAX = 2**63 - 1


def _opts(**kw) -> BuildOptions:
    base = dict(
        max_tokens=4,
        logprobs=None,
        prompt_logprobs=None,
        stop=[],
        stop_token_ids=[],
        base_id="r",
    )
    return BuildOptions(**{**base, **kw})


def test_choice_seeds_wrap_inside_int64():
    assert [choice_seed(7, j) for j in range(3)] == [7, 8, 9]  # unchanged where it fitted
    assert choice_seed(INT64_MAX, 1) == -(2**63)
    seeds = [choice_seed(INT64_MAX - 2, j) for j in range(16)]
    assert len(set(seeds)) == 16 and all(-(2**63) <= s <= INT64_MAX for s in seeds)
    assert choice_seed(-(2**63), 0) == -(2**63)


def test_every_choice_of_a_max_seed_converts_to_protobuf():
    """The issue's request: n=2 with seed 2**63 - 1 overflowed int64 in step_to_pb."""
    req = CompletionRequest.model_validate({"prompt": "hi", "n": 16, "seed": INT64_MAX})
    gens = generation_requests(req, [Prompt([1, 2], "hi")], [4], _opts(), [0], 100)
    assert len({g.sampling.seed for g in gens}) == 16
    for g in gens:
        assert sampling_to_pb(g.sampling).seed == g.sampling.seed


@pytest.mark.parametrize("temperature", [1e-39, 0.0, 9e-6])
def test_tiny_temperatures_are_greedy(temperature):
    req = CompletionRequest.model_validate({"prompt": "hi", "temperature": temperature})
    sampling = sampling_params(req, _opts(), 0, 100)
    assert sampling.greedy and sampling.temperature == 0.0


EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-39, 1e-12, 1e-5, 1.0, 2.0, 2.0000001, 1e308]
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", EXTREME_FLOATS)
def test_every_float_the_api_accepts_is_one_the_executor_accepts(field, value):
    """Either the body is refused (a 400), or the value, as sent over the wire (float32), is
    one the executor's step check accepts: the fuzz test's repetition_penalty 5e-324 passed the
    API's > 0 and reached the executor as 0.0 (a 500)."""
    try:
        req = CompletionRequest.model_validate({"prompt": "hi", field: value})
    except ValidationError:
        return
    wire = sampling_from_pb(sampling_to_pb(sampling_params(req, _opts(), 0, 100)))
    assert sampling_problem(wire, StepLimits()) == "", (field, value)


def test_tiny_repetition_penalties_are_the_strongest_kept_finite():
    for value in (5e-324, 1e-39, 1e-12):
        req = CompletionRequest.model_validate({"prompt": "hi", "repetition_penalty": value})
        assert sampling_params(req, _opts(), 0, 100).repetition_penalty == MIN_REPETITION_PENALTY
    req = CompletionRequest.model_validate({"prompt": "hi", "repetition_penalty": 1e-3})
    assert sampling_params(req, _opts(), 0, 100).repetition_penalty == 1e-3


def test_normal_temperatures_and_top_k_are_kept():
    req = CompletionRequest.model_validate(
        {"prompt": "hi", "temperature": MIN_TEMPERATURE, "top_k": 10**12}
    )
    sampling = sampling_params(req, _opts(), 0, 100)
    assert sampling.temperature == MIN_TEMPERATURE and not sampling.greedy
    assert sampling.top_k == 0  # at least the vocabulary: off (and an int32 on the wire)


def test_token_limit():
    assert token_limit(None, 10, 100, "prompt") == 90
    assert token_limit(5, 10, 100, "prompt") == 5
    with pytest.raises(APIError) as exc:
        token_limit(91, 10, 100, "prompt")
    assert exc.value.param == "max_tokens" and exc.value.code == "context_length_exceeded"
    with pytest.raises(APIError) as exc:
        token_limit(None, 100, 100, "messages")
    assert exc.value.param == "messages"
    with pytest.raises(APIError):
        token_limit(1, 0, 100, "prompt")


def test_error_bodies_always_encode():
    """A lone surrogate (the 404 of model "\\ud800" was a 500) and a huge value: the body
    encodes, short."""
    for value in ("\ud800", "x" * 5_000_000, "\udfff\ud800ok"):
        err = APIError(f"The model `{quote(value)}` does not exist.", 404, value)
        response = error_response(err)
        body = json.loads(response.body)["error"]
        assert len(body["message"]) < 200 and len(body["param"]) < 1100
    assert quote("\ud800") == "?"
