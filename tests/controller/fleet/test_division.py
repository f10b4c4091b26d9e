"""The division of executors between live controllers (controller/fleet/division.py): an even,
deterministic split by rendezvous hashing that moves few executors when a controller joins or
leaves, and the liveness rules of peers, with a fake clock; the /peer probe against a tiny
HTTP server."""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter

import pytest

from controller.fleet.division import PeerTable, divide, rendezvous_order
from controller.fleet.peers import probe


def executors(n: int) -> list[str]:
    return [f"10.0.{i // 250}.{i % 250}:50051" for i in range(n)]


def controllers(m: int) -> list[str]:
    return [f"tandem-controller-{j}.ctl:8000" for j in range(m)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 13, 40, 200, 1000])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_the_split_is_as_even_as_it_can_be(n, m):
    chosen = divide(executors(n), controllers(m))
    assert set(chosen) == set(executors(n))
    loads = Counter(chosen.values())
    counts = [loads.get(c, 0) for c in controllers(m)]
    assert min(counts) >= n // m and max(counts) <= math.ceil(n / m), counts


def test_four_executors_split_two_two_and_one_one_two():
    assert sorted(Counter(divide(executors(4), controllers(2)).values()).values()) == [2, 2]
    assert sorted(Counter(divide(executors(4), controllers(3)).values()).values()) == [1, 1, 2]


def test_the_division_is_deterministic_whatever_the_order_of_its_inputs():
    ex, ctl = executors(50), controllers(4)
    first = divide(ex, ctl)
    assert divide(list(reversed(ex)), list(reversed(ctl))) == first
    assert divide(ex + ex[:5], ctl + ctl[:1]) == first  # duplicates change nothing
    assert rendezvous_order(ex[0], ctl) == rendezvous_order(ex[0], list(reversed(ctl)))


@pytest.mark.parametrize("n", [4, 8, 13, 40, 200, 1000])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 8])
def test_a_join_or_a_leave_moves_few_executors(n, m):
    """A controller joining m others must take about n/(m+1) executors; one leaving gives away
    its own. The load bound adds some moves beyond that (over this grid: 16 % more on average,
    at most 27 % of n, at small n with many controllers; 2 to 16 % more at n = 1000); without
    the bound the split would be uneven."""
    ex, ctl = executors(n), controllers(m + 1)
    before, after = divide(ex, ctl[:m]), divide(ex, ctl)
    joined = sum(before[e] != after[e] for e in ex)
    left = divide(ex, ctl[1:])
    gone = sum(after[e] != left[e] for e in ex)
    least = math.ceil(n / (m + 1))
    for moved in (joined, gone):
        assert moved <= n / (m + 1) + 0.3 * n + 1, (moved, least)
    if n >= 1000:  # measured: 2-16 % above n/(m+1), the most at 8 -> 9 controllers
        assert joined <= 1.2 * n / (m + 1) and gone <= 1.2 * n / (m + 1)
    # Every executor of the leaving controller moves, and only a few others.
    theirs = sum(after[e] == ctl[0] for e in ex)
    assert theirs <= gone <= theirs + 0.3 * n + 1


def test_without_controllers_nothing_is_divided():
    assert divide(executors(3), []) == {}
    assert divide([], controllers(2)) == {}


def test_a_peer_is_live_while_its_last_answer_is_recent():
    table = PeerTable("me:8000", window=3.0)
    assert table.live(now=0.0) == ["me:8000"]  # itself, always
    table.answered("10.0.0.2:8000", "b:8000", "host-b/1", now=10.0)
    assert table.live(now=12.9) == ["b:8000", "me:8000"]
    assert table.live(now=13.0) == ["b:8000", "me:8000"]  # one lost probe or two: still live
    assert table.live(now=13.1) == ["me:8000"]  # past the window: gone
    table.answered("10.0.0.2:8000", "b:8000", "host-b/1", now=14.0)  # it answers again
    assert table.live(now=14.5) == ["b:8000", "me:8000"]
    assert table.owner_of("b:8000") == "host-b/1" and table.owner_of("x:1") == ""
    table.forget(["10.0.0.9:8000"])  # it left discovery: its answers go at once
    assert table.live(now=14.5) == ["me:8000"]


def test_claims_follow_liveness_with_a_fake_clock():
    """The claim rules: a controller drives the executors the division over the live set gives
    it; when a peer stops answering, its executors go to the next in their rendezvous order
    once the window passes (not before), and come back when it answers again."""
    ex = executors(4)
    me, other = "a:8000", "b:8000"
    table = PeerTable(me, window=1.5)
    table.answered("b-probe", other, "host-b/1", now=0.0)
    both = divide(ex, table.live(now=1.0))
    mine = {e for e, c in both.items() if c == me}
    assert len(mine) == 2
    assert divide(ex, table.live(now=1.5)) == both  # within the window: nothing moves
    alone = divide(ex, table.live(now=1.6))
    assert set(alone.values()) == {me}  # b judged gone: a claims all four
    table.answered("b-probe", other, "host-b/2", now=5.0)  # b back (a new process)
    assert divide(ex, table.live(now=5.1)) == both  # the same split as before: deterministic


def test_probe_reads_a_peer_answer():
    async def run():
        async def serve(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            body = json.dumps({"address": "b:8000", "owner": "host-b/1"}).encode()
            writer.write(
                b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                + f"content-length: {len(body)}\r\n\r\n".encode()
                + body
            )
            await writer.drain()
            writer.close()

        async def refuse(reader, writer):
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 503 Service Unavailable\r\ncontent-length: 2\r\n\r\n{}")
            await writer.drain()
            writer.close()

        ok = await asyncio.start_server(serve, "127.0.0.1", 0)
        draining = await asyncio.start_server(refuse, "127.0.0.1", 0)
        async with ok, draining:
            port = ok.sockets[0].getsockname()[1]
            answer = await probe(f"127.0.0.1:{port}")
            assert answer == {"address": "b:8000", "owner": "host-b/1"}
            port = draining.sockets[0].getsockname()[1]
            with pytest.raises(ValueError):
                await probe(f"127.0.0.1:{port}")

    asyncio.run(run())
