"""Structured output in the scheduler: a constrained request's sampling steps carry its
allowed tokens, its grammar advances with each token received, it ends when the grammar is
complete, and it is never scheduled with a token in flight (its mask depends on it). A fake
grammar (a fixed token sequence) and the fake executor, which samples only allowed tokens."""

from __future__ import annotations

import pytest

from common.wire.step_types import token_mask_bytes
from controller.core.scheduler import Scheduler
from tests.controller.core.harness import (
    FakeExecutor,
    drive,
    expected_output,
    make_config,
    make_request,
)
from tests.controller.core.test_pipeline import drive_pipelined

VOCAB = 2048


class SequenceGrammar:
    """A grammar whose only valid output is `target`, token by token."""

    def __init__(self, target: list[int], dead_after: int | None = None):
        self.target = target
        self.dead_after = dead_after  # from this position on, no token is allowed
        self.pos = 0  # tokens accepted
        self.masks = 0  # masks computed
        self.failed = False

    def allowed_mask(self) -> bytes:
        self.masks += 1
        if self.dead_after is not None and self.pos >= self.dead_after:
            return bytes(token_mask_bytes(VOCAB))
        bits = 1 << self.target[self.pos]
        return bits.to_bytes(token_mask_bytes(VOCAB), "little")

    def accept(self, token_id: int) -> bool:
        if self.pos >= len(self.target) or token_id != self.target[self.pos]:
            self.failed = True
            return False
        self.pos += 1
        return True

    def is_finished(self) -> bool:
        return self.failed or self.pos == len(self.target)

    @property
    def error(self) -> str:
        return "refused" if self.failed else ""


TARGET = [1500, 1501, 1502, 1503, 1504]


def constrained(rid: str, prompt, **kw):
    req = make_request(rid, prompt, max_tokens=kw.pop("max_tokens", 50), **kw)
    req.grammar = SequenceGrammar(list(TARGET))
    return req


def test_constrained_output_follows_the_grammar_and_ends_when_complete():
    sched = Scheduler(make_config(max_num_batched_tokens=32))
    sched.add_request(constrained("c", 70))  # chunked prefill: masks only with samples
    free = make_request("f", 20, max_tokens=8)
    sched.add_request(free)
    ex = FakeExecutor()
    assert sched.needs_results_first()
    out = drive(sched, ex)
    assert out["c"].tokens == TARGET and out["c"].reason == "stop"
    assert out["f"].tokens == expected_output(free.prompt_token_ids, 8)  # unconstrained: same
    assert ex.masks_seen == len(TARGET)  # one per sample, none with a partial prefill chunk
    assert not sched.needs_results_first()  # nothing constrained is left


def test_a_token_the_grammar_refuses_fails_the_request_alone():
    sched = Scheduler(make_config())
    sched.add_request(constrained("c", 10))
    sched.add_request(make_request("f", 10, max_tokens=4))
    ex = FakeExecutor()
    ex.ignore_masks = True  # an executor that samples outside the mask
    out = drive(sched, ex)
    assert out["c"].reason == "error" and out["c"].tokens
    assert "no longer matches its grammar" in out["c"].updates[-1].error
    assert out["f"].reason == "length"


@pytest.mark.parametrize("depth", [2, 3])
def test_pipelined_steps_never_schedule_a_constrained_request_with_a_token_in_flight(depth):
    """Driven with steps in flight (the engine's loop would wait for results first; the
    scheduler itself must hold a constrained request back anyway): every mask the executor
    gets is for the request's current position, and the free requests still pipeline."""
    sched = Scheduler(make_config(max_num_batched_tokens=64))
    grammar_reqs = [constrained(f"c{i}", 12 + i) for i in range(3)]
    free = [make_request(f"f{i}", 9 + i, max_tokens=12) for i in range(3)]
    for r in grammar_reqs + free:
        sched.add_request(r)
    results = drive_pipelined(sched, FakeExecutor(), depth)
    for r in grammar_reqs:
        assert results[r.request_id].tokens == TARGET
        assert results[r.request_id].reason == "stop"
        assert r.grammar.masks == len(TARGET)  # one mask per token: none wasted or stale
    for r in free:
        assert results[r.request_id].tokens == expected_output(r.prompt_token_ids, 12)
    assert sched.kv.num_used_blocks == 0


def test_a_preempted_constrained_request_resumes_at_its_grammar_position():
    """A pool too small for both: the later request is preempted and recomputed; its
    grammar keeps its position (the output so far stays), and it finishes valid."""
    sched = Scheduler(make_config(num_blocks=6, max_num_batched_tokens=64))
    sched.add_request(make_request("f", 40, max_tokens=30))
    req = constrained("c", 30)
    sched.add_request(req)
    out = drive(sched, FakeExecutor())
    assert req.num_preemptions >= 1
    assert out["c"].tokens == TARGET and out["c"].reason == "stop"
    assert req.grammar.masks == len(TARGET)  # a position's mask is reused after preemption


def test_a_grammar_that_cannot_be_continued_ends_the_request_with_an_error():
    """No token allowed after the second: the request ends at once with the reason (the
    mask is computed when its token arrives, not sent as an empty mask)."""
    sched = Scheduler(make_config())
    req = make_request("c", 10, max_tokens=50)
    req.grammar = SequenceGrammar(list(TARGET), dead_after=2)
    sched.add_request(req)
    ex = FakeExecutor()
    out = drive(sched, ex)
    assert out["c"].tokens == TARGET[:2] and out["c"].reason == "error"
    assert "cannot be completed under its grammar" in out["c"].updates[-1].error
    assert ex.masks_seen == 2


def test_length_ends_a_constrained_request_before_its_grammar():
    sched = Scheduler(make_config())
    sched.add_request(constrained("c", 10, max_tokens=3))
    out = drive(sched, FakeExecutor())
    assert out["c"].tokens == TARGET[:3] and out["c"].reason == "length"
