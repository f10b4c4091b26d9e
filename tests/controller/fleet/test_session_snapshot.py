"""A session's snapshot against its state, without a model or a process: the session runs its
real lifecycle and step loop against a fake executor client (placement, steps, a loss)."""

from __future__ import annotations

import asyncio

import pytest

from tests.controller.fleet.fakes import ADDRESS, FakeClient, fake_session, tracked_request, until


def test_snapshot_follows_the_session_through_placement_steps_and_a_loss():
    async def main() -> None:
        client = FakeClient()
        session, owner = fake_session(client, max_num_seqs=4, source="dns")

        fresh = session.snapshot()
        assert (fresh.address, fresh.source, fresh.state) == (ADDRESS, "dns", "connecting")
        assert (fresh.kind, fresh.device, fresh.incarnation, fresh.incarnations) == (
            None,
            None,
            None,
            0,
        )
        assert not fresh.healthy and not fresh.connected and fresh.block_size == 0
        assert (fresh.overhead, fresh.measured_steps) == (pytest.approx(0.03), 0)

        session.start()
        await until(lambda: session.healthy, "the handshake")
        up = session.snapshot()
        assert owner.ready == [ADDRESS]
        assert (up.kind, up.device, up.incarnation, up.incarnations) == (
            "cpu",
            "fake-cpu",
            "inc-1",
            1,
        )
        assert (
            up.state == "healthy"
            and up.healthy
            and up.connected
            and up.state_since >= fresh.state_since
        )
        assert (up.num_blocks, up.block_size, up.free_blocks, up.used_blocks) == (64, 16, 63, 0)
        assert (up.max_num_seqs, up.max_num_batched_tokens) == (4, 256)  # settings within caps

        # Two requests placed, before the step loop runs: queued, nothing computed yet.
        a, b = tracked_request("a", 40, 3), tracked_request("b", 20, 5)
        session.add(a)
        session.add(b)
        assert a.placed_on == ADDRESS and b.placed_on == ADDRESS
        placed = session.snapshot(expected_output=4)
        assert (placed.requests, placed.requests_placed, placed.waiting, placed.running) == (
            2,
            2,
            2,
            0,
        )
        assert placed.uncomputed_tokens == 60
        assert placed.decode_tokens == 3 + 4  # each capped at the expected output
        assert session.snapshot().decode_tokens == 0

        # Steps applied until both finish.
        await until(lambda: len(owner.done) == 2, "both requests")
        done = session.snapshot()
        assert sorted(owner.done) == [("a", "length", ADDRESS), ("b", "length", ADDRESS)]
        assert a.placed_on is None and (done.requests, done.running, done.waiting) == (0, 0, 0)
        assert (done.used_blocks, done.kv_usage) == (0, 0.0)
        assert (done.steps, done.tokens) == (client.steps, client.tokens) and done.steps >= 5
        assert done.tokens == 40 + 20 + 2 + 4  # prompts, then one token per later output
        assert done.measured_steps == done.steps and done.tokens_per_second > 0
        stats = session.scheduler.stats()
        assert (done.prefix_cache_queries, done.prefix_cache_hits) == (
            stats.prefix_cache_queries,
            stats.prefix_cache_hits,
        )
        assert done.prefix_cache_queries > 0

        # A loss while a request runs: it is handed back detached, the snapshot says why.
        c = tracked_request("c", 30, 50)
        client.lose_next = True
        session.add(c)
        await until(lambda: owner.at_loss is not None, "the loss")
        lost = owner.at_loss
        assert [t.gen.request_id for t in owner.moved] == ["c"] and c.placed_on is None
        assert lost.state == "unhealthy" and not lost.healthy and not lost.connected
        assert (lost.losses, lost.last_loss, lost.requests, lost.running) == (
            1,
            "stream broke",
            0,
            0,
        )
        assert lost.requests_placed == 3 and lost.max_num_seqs == 0
        # The retired scheduler's prefix counters are kept: over every connection.
        assert lost.prefix_cache_queries >= done.prefix_cache_queries

        await until(lambda: session.healthy, "the reconnect")
        back = session.snapshot()
        assert (back.reconnects, back.losses, back.incarnations) == (1, 1, 1)  # same process
        assert back.connected and back.connect_error == "" and back.used_blocks == 0
        assert back.prefix_cache_queries == lost.prefix_cache_queries
        assert owner.ready == [ADDRESS, ADDRESS]
        await session.stop()
        assert owner.removed == [ADDRESS] and session.snapshot().state == "removed"

    asyncio.run(main())
