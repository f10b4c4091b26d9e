"""Sequence ids derive from the request id, and the request id is recovered from them."""

from __future__ import annotations

import pytest

from common.wire.request_ids import request_id_of, sequence_id


@pytest.mark.parametrize(
    "request_id",
    ["abc", "0f3c9e2a1b7d4c5e8f9a0b1c2d3e4f5a", "a-1-2", "x-y", "9", "Root=1-5f/4+a:b.c_d"],
)
def test_round_trip(request_id):
    for p, c in [(0, 0), (3, 12)]:
        seq = sequence_id(request_id, p, c)
        assert request_id in seq
        assert request_id_of(seq) == request_id
        renamed = sequence_id(f"{request_id}~4", p, c)  # a client's id with its serial
        assert request_id_of(renamed) == request_id


@pytest.mark.parametrize("other", ["r1", "req-0", "a-b-c", "-0-0", "x-0-", "x-٣-0", ""])
def test_other_shapes_are_returned_whole(other):
    assert request_id_of(other) == other


def test_clash_mark_needs_a_serial():
    assert request_id_of("a~b-0-0") == "a~b"
