"""The core <-> writer messages: a step frame round-trips exactly, its size is bounded by its
sequences and tokens alone, and a malformed one is refused."""

from __future__ import annotations

import random
from array import array

import pytest

from common.wire.step_types import TokenLogprobs
from controller.api.writers import frame as fr


def _random_step(rng: random.Random, n: int) -> tuple[list, list, list]:
    slots = rng.sample(range(1 << 31), n)
    ids = [[rng.randrange(-5, 1 << 31) for _ in range(rng.randrange(0, 5))] for _ in range(n)]
    reasons = [rng.choice(fr.FINISH_REASONS) for _ in range(n)]
    return slots, ids, reasons


@pytest.mark.parametrize("n", [0, 1, 7, 256])
def test_step_round_trip_and_size(n):
    rng = random.Random(n)
    slots, ids, reasons = _random_step(rng, n)
    builder = fr.StepBuilder()
    for slot, tokens, reason in zip(slots, ids, reasons):
        builder.add(slot, tokens, reason)
    assert len(builder) == n
    message = builder.take()
    assert len(builder) == 0  # the builder starts over
    total = sum(len(t) for t in ids)
    assert len(message) == fr.step_size(n, total) == 9 + 9 * n + 4 * total
    step = fr.decode_step(message)
    assert step.slots.tolist() == slots
    assert step.counts.tolist() == [len(t) for t in ids]
    assert [fr.FINISH_REASONS[c] for c in step.finish] == reasons
    assert step.token_ids.tolist() == [i for t in ids for i in t]


def test_malformed_steps_are_refused():
    message = fr.encode_step(
        fr.StepFrame(array("I", [3]), array("I", [2]), array("B", [0]), array("i", [5, 6]))
    )
    with pytest.raises(ValueError):
        fr.decode_step(message[:-1])
    with pytest.raises(ValueError):
        fr.decode_step(message + b"\0")
    with pytest.raises(ValueError):
        fr.decode_step(fr.encode_control(fr.DONE, 3))
    with pytest.raises(ValueError):  # counts that do not add up
        fr.encode_step(
            fr.StepFrame(array("I", [3]), array("I", [1]), array("B", [0]), array("i", [5, 6]))
        )


def test_control_messages():
    meta = {"response_id": "cmpl-é", "sequences": [4, 5]}
    slot, back = fr.decode_open(fr.encode_open(9, meta))
    assert (slot, back) == (9, meta)
    kind, slot, extra = fr.decode_head(fr.encode_control(fr.DONE, 12, 3))
    assert (kind, slot, fr.DONE_REASONS[extra]) == (fr.DONE, 12, "closed")


def _lp(rng: random.Random, token: int) -> TokenLogprobs:
    k = rng.randrange(0, 6)
    top = [rng.randrange(1 << 31) for _ in range(k)]
    values = [array("f", [-rng.random() * 10])[0] for _ in range(k)]
    return TokenLogprobs(token, array("f", [-rng.random()])[0], 1, top, values)


@pytest.mark.parametrize("n", [1, 7, 64])
def test_a_step_with_logprobs_round_trips(n):
    """Sequences with and without logprobs in one frame: each one's entries come back as sent
    (float32 values exactly), the others' as none."""
    rng = random.Random(100 + n)
    slots, ids, reasons = _random_step(rng, n)
    lps = [None if rng.random() < 0.3 else [_lp(rng, t) for t in tokens] for tokens in ids]
    lps[0] = [_lp(rng, t) for t in ids[0]]  # at least one asked for them
    builder = fr.StepBuilder()
    for slot, tokens, reason, lp in zip(slots, ids, reasons, lps):
        builder.add(slot, tokens, reason, lp)
    size = builder.size()
    message = builder.take()
    assert len(message) == size
    step = fr.decode_step(message)
    assert step.token_ids.tolist() == [i for t in ids for i in t]
    got, entry_at, top_at = [], 0, 0
    for i in range(n):
        one, entry_at, top_at = step.logprobs.of(i, entry_at, top_at)
        got.append(one)
    for sent, back in zip(lps, got):
        want = [(x.token_id, x.logprob, x.top_token_ids, x.top_logprobs) for x in sent or []]
        assert [(x.token_id, x.logprob, x.top_token_ids, x.top_logprobs) for x in back] == want
    with pytest.raises(ValueError):
        fr.decode_step(message[:-1])
    with pytest.raises(ValueError):
        fr.decode_step(message + b"\0")


def _sequences(messages: list[bytes]) -> list[tuple[int, list[int], int, list]]:
    """(slot, ids, finish code, logprobs) per sequence entry over several STEPs, in order."""
    out = []
    for message in messages:
        step = fr.decode_step(message)
        at = entry_at = top_at = 0
        for i, (slot, count, code) in enumerate(zip(step.slots, step.counts, step.finish)):
            lps = []
            if step.logprobs is not None:
                lps, entry_at, top_at = step.logprobs.of(i, entry_at, top_at)
            out.append((slot, step.token_ids[at : at + count].tolist(), code, lps))
            at += count
    return out


@pytest.mark.parametrize("limit", [200, 1000, 1 << 20])
def test_a_step_over_the_limit_is_split_never_dropped(limit):
    """A step larger than a message may be comes out as several, each within the limit, the
    sequences in order; a sequence too large alone is cut between its tokens (its end in the
    last piece). Nothing is lost."""
    rng = random.Random(limit)
    builder, sent = fr.StepBuilder(), []
    big = limit // 3  # one sequence with more ids than a message holds
    for slot in range(40):
        count = big if slot == 7 else rng.randrange(0, 20)
        tokens = [rng.randrange(1 << 20) for _ in range(count)]
        reason = rng.choice(fr.FINISH_REASONS)
        lps = [_lp(rng, t) for t in tokens] if slot % 3 == 0 else None
        builder.add(slot, tokens, reason, lps)
        sent.append((slot, tokens, fr.FINISH_CODES[reason], lps))
    messages = builder.take_all(limit)
    assert len(builder) == 0
    assert all(len(m) <= limit for m in messages)
    assert len(messages) > 1  # its slot 7 alone holds more than a message
    got = _sequences(messages)
    merged: list = []
    for slot, tokens, code, lps in got:
        if merged and merged[-1][0] == slot:  # a piece of the sequence before
            assert merged[-1][2] == 0, "a sequence's end comes in its last piece"
            merged[-1] = (slot, merged[-1][1] + tokens, code, merged[-1][3] + lps)
        else:
            merged.append((slot, tokens, code, lps))
    assert [(s, t, c) for s, t, c, _ in merged] == [(s, t, c) for s, t, c, _ in sent]
    for (_, _, _, back), (_, _, _, lps) in zip(merged, sent):
        assert [x.top_token_ids for x in back] == [x.top_token_ids for x in lps or []]


def test_a_sequence_with_fewer_logprobs_than_tokens_is_split_within_the_limit():
    """Logprobs not one per token (not what the scheduler sends, but a frame may say so) go
    whole with the sequence's last piece, every piece still within the limit."""
    rng = random.Random(5)
    tokens = list(range(2000))
    lps = [_lp(rng, t) for t in tokens[:30]]
    builder = fr.StepBuilder()
    builder.add(4, tokens, "length", lps)
    messages = builder.take_all(1500)
    assert len(messages) > 1 and all(len(m) <= 1500 for m in messages)
    got = _sequences(messages)
    assert [i for _, ids, _, _ in got for i in ids] == tokens
    assert [len(lp) for _, _, _, lp in got[:-1]] == [0] * (len(got) - 1)
    assert [x.token_id for x in got[-1][3]] == tokens[:30]
    assert [code for _, _, code, _ in got] == [0] * (len(got) - 1) + [fr.FINISH_CODES["length"]]
