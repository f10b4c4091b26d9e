"""The core <-> writer messages: a step frame round-trips exactly, its size is bounded by its
sequences and tokens alone, and a malformed one is refused."""

from __future__ import annotations

import random
from array import array

import pytest

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
