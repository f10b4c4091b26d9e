"""The bounds on one request's body: each check alone, the raw-shape checks that run before
pydantic, and the settings they read."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from controller.api import request_limits as limits
from controller.api.errors import APIError
from controller.api.protocol import MAX_PROMPT_IDS, MAX_PROMPTS, CompletionRequest
from controller.api.request_limits import RequestLimits
from controller.api.shapes import check_prompt_shape
from controller.settings import ControllerConfig

LIMITS = RequestLimits(
    max_sequences=8,
    max_prompt_tokens=100,
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_stop_token_ids=3,
    max_chat_messages=4,
    max_tools=2,
    max_logprobs=5,
)


def _param(call) -> str | None:
    with pytest.raises(APIError) as exc:
        call()
    assert exc.value.status == 400 and exc.value.message
    return exc.value.param


def test_settings_become_limits():
    config = ControllerConfig(model="m", max_request_sequences=7, max_stop_strings=3)
    got = RequestLimits.from_config(config, max_logprobs=9)
    assert (got.max_sequences, got.max_stop_strings, got.max_logprobs) == (7, 3, 9)
    assert got.max_prompt_tokens == config.max_request_prompt_tokens == 1 << 20
    assert got.stream_stall_timeout == config.stream_stall_timeout == 30.0
    # A configuration without these settings (a test's fake) gets the defaults.
    assert RequestLimits.from_config(SimpleNamespace(model="m"), 20) == RequestLimits()


def test_sequences():
    limits.check_sequences(2, 4, 8)
    assert _param(lambda: limits.check_sequences(1, 9, 8)) == "n"
    with pytest.raises(APIError) as exc:
        limits.check_sequences(300_000, 16, 8)
    assert exc.value.param == "prompt" and exc.value.code == "too_many_sequences"


def test_stop_strings_and_ids():
    assert limits.check_stop("abc", LIMITS) == ["abc"]
    assert limits.check_stop(None, LIMITS) == []
    assert _param(lambda: limits.check_stop(["a", "b", "c"], LIMITS)) == "stop"
    assert _param(lambda: limits.check_stop("x" * 6, LIMITS)) == "stop"
    assert limits.check_stop_token_ids([1, 2], LIMITS, vocab=10) == [1, 2]
    assert _param(lambda: limits.check_stop_token_ids([1, 2, 3, 4], LIMITS, 10)) == (
        "stop_token_ids"
    )
    assert _param(lambda: limits.check_stop_token_ids([10], LIMITS, 10)) == "stop_token_ids"
    assert _param(lambda: limits.check_stop_token_ids([-1], LIMITS, 10)) == "stop_token_ids"
    assert _param(lambda: limits.check_stop_token_ids([2**40], LIMITS, 10)) == "stop_token_ids"


def test_logprobs_text_tokens_and_chat():
    limits.check_logprobs(5, "logprobs", LIMITS)
    limits.check_logprobs(None, "logprobs", LIMITS)
    assert _param(lambda: limits.check_logprobs(6, "top_logprobs", LIMITS)) == "top_logprobs"
    limits.check_text_length(10**9, None, 100, "prompt")  # no bound for this tokenizer
    limits.check_text_length(500, 500, 100, "prompt")
    assert _param(lambda: limits.check_text_length(501, 500, 100, "prompt")) == "prompt"
    limits.check_prompt_tokens([50, 50], LIMITS, "prompt")
    assert _param(lambda: limits.check_prompt_tokens([50, 51], LIMITS, "prompt")) == "prompt"
    limits.check_chat(4, [{}, {}], LIMITS)
    assert _param(lambda: limits.check_chat(5, None, LIMITS)) == "messages"
    assert _param(lambda: limits.check_chat(1, [{}] * 3, LIMITS)) == "tools"
    assert limits.content_chars("abc") == 3
    assert limits.content_chars([{"type": "text", "text": "ab"}, {"type": "text"}]) == 2


def test_prompt_shape_is_checked_before_pydantic():
    """300,000 one-token prompts: refused in milliseconds (pydantic alone took a second and a
    half to report 300,000 errors), and no check quotes the input."""
    huge = [[1]] * 300_000
    started = time.perf_counter()
    with pytest.raises(ValidationError) as exc:
        CompletionRequest.model_validate({"prompt": huge, "n": 16})
    assert time.perf_counter() - started < 0.5
    assert exc.value.error_count() == 1 and "[1]" not in exc.value.errors()[0]["msg"]
    for bad in ([1, "a"], [[1], [1.5]], [[1], "a"], ["a", 1], [1, True]):
        with pytest.raises(ValueError):
            check_prompt_shape(bad, MAX_PROMPTS, MAX_PROMPT_IDS)
    with pytest.raises(ValueError):
        check_prompt_shape([1] * 11, 5, 10)
    with pytest.raises(ValueError):
        check_prompt_shape([[1] * 6, [1] * 6], 5, 10)
    for good in ("text", ["a", "b"], [1, 2], [[1], [2, 3]], []):
        assert check_prompt_shape(good, MAX_PROMPTS, MAX_PROMPT_IDS) is good


@pytest.mark.parametrize(
    "field,value",
    [
        ("seed", 2**63),
        ("seed", -(2**63) - 1),
        ("max_tokens", 2**31),
        ("min_tokens", 2**31),
        ("logprobs", 2**31),
        ("priority", 2**63),
        ("n", 17),
    ],
)
def test_integers_bound_for_the_wire_are_refused_by_the_model(field, value):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "hi", field: value})
    ok = {"seed": 2**63 - 1, "max_tokens": 2**31 - 1, "priority": -(2**63)}
    CompletionRequest.model_validate({"prompt": "hi", **ok})
