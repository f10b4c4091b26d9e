"""Executors trust nothing: the checks every executor kind runs on each step
(common.host.step_check, through RequestTable). A bad request is rejected alone, with a reason
and its state dropped; the good requests of the same step run."""

from __future__ import annotations

import math

import pytest

from common.host.request_table import RequestTable
from common.host.step_check import StepLimits, sampling_problem
from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput
from tests.support.token_masks import pack_mask, unpack_mask

LIMITS = StepLimits(
    num_blocks=32,
    block_size=4,
    vocab_size=1000,
    max_model_len=64,
    max_tokens_per_step=40,
    max_num_seqs=4,
    max_logprobs=5,
)


def new(rid: str, prompt=(1, 2, 3, 4), blocks=(1,), scheduled=None, **sampling) -> NewRequestData:
    prompt = list(prompt)
    n = len(prompt) if scheduled is None else scheduled
    return NewRequestData(rid, prompt, [], SamplingParams(**sampling), list(blocks), 0, n)


def apply(table: RequestTable, *new_requests, cached=(), finished=()):
    step = StepInput(1, list(new_requests), list(cached), list(finished))
    runnable, errors = table.apply(step)
    return [state.request_id for state, _, _ in runnable], errors


@pytest.mark.parametrize(
    "bad, why",
    [
        (new("bad", blocks=(32,)), "block id is outside [1, 32)"),
        (new("bad", blocks=(-1,)), "block id is outside"),
        (new("bad", blocks=(0,)), "block id is outside"),  # the null block is nobody's
        (new("bad", blocks=(1, 10**9)), "block id is outside"),
        (new("bad", blocks=tuple(range(1, 18))), "17 KV blocks exceed 16 per request"),
        (new("bad", prompt=(1, 1000)), "token id outside [0, 1000)"),
        (new("bad", prompt=(-5, 1)), "token id outside"),
        (new("bad", prompt=()), "empty prompt"),
        (new("bad", [1] * 65, tuple(range(1, 17)), scheduled=4), "exceed max_model_len 64"),
        (new("bad", scheduled=5), "only 4 are known"),
        (new("bad", scheduled=0), "bad schedule"),
        (new("bad", prompt=[1] * 8, blocks=(1,)), "needs 2 KV blocks, has 1"),
        (new("bad", prompt=[1] * 41, blocks=tuple(range(1, 12))), "more than 40 tokens"),
        (new("bad", temperature=math.nan), "temperature"),
        (new("bad", temperature=-1.0), "temperature"),
        (new("bad", top_p=1.5), "top_p"),
        (new("bad", top_k=-7), "top_k"),
        (new("bad", min_p=math.inf), "min_p"),
        (new("bad", presence_penalty=3.0), "presence_penalty"),
        (new("bad", repetition_penalty=0.0), "repetition_penalty"),
        (new("bad", logprobs=6), "logprobs 6 is outside [0, 5]"),
        (new("bad", prompt_logprobs=-1), "prompt_logprobs"),
        (new("bad", seed=2**63), "seed"),
        (new("bad", min_tokens=2, stop_token_ids=[5, 1000]), "stop token id"),
    ],
)
def test_a_bad_new_request_is_rejected_alone(bad, why):
    table = RequestTable(LIMITS)
    ran, errors = apply(table, new("a", blocks=(2,)), bad, new("b", blocks=(3,)))
    assert ran == ["a", "b"]
    assert list(errors) == ["bad"] and why in errors["bad"]
    assert "bad" not in table.requests


def test_released_leading_blocks_may_be_the_null_block():
    """A sliding-window model's controller gives back blocks out of the window: entries wholly
    before the computation's start may be block 0; an entry the step writes may not."""
    table = RequestTable(LIMITS)
    prompt = list(range(1, 11))
    ok = NewRequestData("ok", prompt, [], SamplingParams(), [0, 0, 5], 8, 2)
    bad = NewRequestData("bad", prompt, [], SamplingParams(), [0, 0, 0], 8, 2)
    ran, errors = apply(table, ok, bad)
    assert ran == ["ok"] and "block id is outside" in errors["bad"]


def test_step_wide_checks_reject_only_the_requests_at_fault():
    table = RequestTable(LIMITS)
    apply(table, new("held", blocks=(1,)))
    # A new request under a held id, an unknown cached id, an id scheduled twice.
    ran, errors = apply(
        table,
        new("held", blocks=(2,)),
        new("twice", blocks=(3,)),
        new("ok", blocks=(4,)),
        cached=[CachedRequestData("ghost", [], 0, 1), CachedRequestData("twice", [], 0, 1)],
    )
    assert ran == ["ok"]
    assert "already held" in errors["held"] and "held" not in table.requests  # state void
    assert "unknown request" in errors["ghost"]
    assert "scheduled 2 times" in errors["twice"]
    # A finished id dropped first: the same id may then come back whole.
    ran, errors = apply(table, new("ok", blocks=(5,)), finished=["ok"])
    assert ran == ["ok"] and not errors


def test_requests_past_the_step_limits_are_rejected_the_others_run():
    table = RequestTable(LIMITS)
    many = [new(f"r{i}", blocks=(i + 1,)) for i in range(5)]
    ran, errors = apply(table, *many)
    assert ran == ["r0", "r1", "r2", "r3"] and list(errors) == ["r4"]
    assert "more than 4 requests" in errors["r4"]
    table = RequestTable(LIMITS)
    big = new("big", prompt=[7] * 36, blocks=tuple(range(1, 10)))
    ran, errors = apply(table, big, new("small", blocks=(10,)), new("more", blocks=(11,)))
    assert ran == ["big", "small"] and "more than 40 tokens" in errors["more"]


def test_a_bad_cached_request_is_rejected_alone_and_forgotten():
    table = RequestTable(LIMITS)
    apply(table, new("a", prompt=(1, 2, 3), blocks=(1,)), new("b", prompt=(1, 2, 3), blocks=(2,)))
    for rid in ("a", "b"):
        table.requests[rid].token_ids.append(9)  # each sampled a token
    ran, errors = apply(
        table,
        cached=[
            CachedRequestData("a", [0], 3, 1),  # the null block
            CachedRequestData("b", [], 3, 1),
        ],
    )
    assert ran == ["b"] and "block id is outside" in errors["a"] and "a" not in table.requests
    ran, errors = apply(table, cached=[CachedRequestData("b", [], 4, 2)])  # past known tokens
    assert ran == [] and "only 4 are known" in errors["b"] and len(table) == 0


def test_sane_sampling_passes():
    for params in (
        SamplingParams(),
        SamplingParams(temperature=1e-39),  # below the epsilon: greedy, not NaN
        SamplingParams(temperature=2.0, top_p=0.9, top_k=-1, min_p=0.1, seed=-(2**63)),
        SamplingParams(logprobs=5, prompt_logprobs=0, min_tokens=3, stop_token_ids=[0, 999]),
    ):
        assert sampling_problem(params, LIMITS) == ""
    assert SamplingParams(temperature=1e-39).greedy and not SamplingParams(temperature=1e-4).greedy


def _masked(rid: str, mask: bytes, blocks=(1,)) -> NewRequestData:
    r = new(rid, blocks=blocks)
    r.allowed_token_mask = mask
    return r


@pytest.mark.parametrize(
    "mask, why",
    [
        (pack_mask([5], 1000)[:-4], "holds 124 bytes, not 128"),
        (pack_mask([5], 1000) + b"\0\0\0\0", "holds 132 bytes"),
        (bytes(128), "allows no token"),
        # Only padding bits past the vocabulary (tokens 1000..1023): nothing samplable.
        (((1 << 1024) - (1 << 1000)).to_bytes(128, "little"), "allows no token"),
    ],
)
def test_a_bad_token_mask_fails_its_request_alone(mask, why):
    """A mask of the wrong length or allowing no token fails its request (new or cached), before
    any state is built; the other requests of the step run."""
    table = RequestTable(LIMITS)
    good = pack_mask([0, 999], 1000)
    ran, errors = apply(
        table, _masked("a", good, (2,)), _masked("bad", mask), new("b", blocks=(3,))
    )
    assert ran == ["a", "b"] and list(errors) == ["bad"] and why in errors["bad"]
    assert "bad" not in table.requests
    for rid in ("a", "b"):
        table.requests[rid].token_ids.append(9)
    ran, errors = apply(
        table,
        cached=[CachedRequestData("a", [5], 4, 1, mask), CachedRequestData("b", [6], 4, 1, good)],
    )
    assert ran == ["b"] and why in errors["a"] and "a" not in table.requests


def test_a_mask_holds_for_its_step_only():
    """Each step brings the mask of the position it samples; a step without one leaves the
    request unconstrained."""
    table = RequestTable(LIMITS)
    first = pack_mask([7], 1000)
    apply(table, _masked("a", first))
    state = table.requests["a"]
    assert state.allowed_token_mask == first
    state.token_ids.append(7)
    second = pack_mask([8, 999], 1000)
    apply(table, cached=[CachedRequestData("a", [5], 4, 1, second)])
    assert state.allowed_token_mask == second and unpack_mask(second, 1000) == {8, 999}
    state.token_ids.append(8)
    apply(table, cached=[CachedRequestData("a", [], 5, 1)])
    assert state.allowed_token_mask is None
