"""A session following the division between controllers (controller/fleet/handover.py),
without a model or a process: its real lifecycle and step loop against a fake executor client.
An executor another controller gets is never connected; a connected one is drained, then
released; one whose drain runs out hands its requests back (they move) without counting a
loss; given back, it connects again."""

from __future__ import annotations

import asyncio

from tests.controller.fleet.fakes import FakeClient, FakeOwner, fake_session, tracked_request, until


class CountingClient(FakeClient):
    """A FakeClient counting handshakes and releases."""

    def __init__(self) -> None:
        super().__init__()
        self.handshakes = 0
        self.releases = 0

    async def handshake(self, *args, **kwargs):
        self.handshakes += 1
        return await super().handshake(*args, **kwargs)

    async def release_session(self, timeout: float) -> bool:
        self.releases += 1
        return True


def test_an_executor_of_another_controller_is_never_connected_until_given_back():
    async def main() -> None:
        owner, client = FakeOwner(), CountingClient()
        session = fake_session(owner, client, max_num_seqs=4)
        session.assign("b:8000")
        session.start()
        await until(lambda: session.state.value == "assigned_elsewhere", "idle")
        await asyncio.sleep(0.05)
        assert client.handshakes == 0 and not session.healthy
        snap = session.snapshot()
        assert (snap.assigned_to, snap.owned, snap.connected) == ("b:8000", False, False)
        session.assign("")  # given back: it connects
        await until(lambda: session.healthy, "the handshake")
        assert client.handshakes == 1 and session.snapshot().assigned_to == ""
        await session.stop()

    asyncio.run(main())


def test_a_hand_over_drains_the_requests_then_releases():
    async def main() -> None:
        owner, client = FakeOwner(), CountingClient()
        session = fake_session(owner, client, max_num_seqs=4)
        session.start()
        await until(lambda: session.healthy, "the handshake")
        running = tracked_request("r", 20, 40)
        session.add(running)
        await until(lambda: client.steps >= 3, "a few steps")
        session.assign("b:8000")
        assert session.state.value == "draining" and not session.healthy  # no new work
        await until(lambda: session.state.value == "assigned_elsewhere", "the hand-over")
        assert owner.done == [("r", "length", session.address)]  # it finished here
        assert owner.moved == [] and client.releases == 1
        snap = session.snapshot()
        assert (snap.losses, snap.connected, snap.used_blocks) == (0, False, 0)
        await session.stop()

    asyncio.run(main())


def test_a_drain_that_runs_out_moves_the_requests_without_a_loss():
    async def main() -> None:
        owner, client = FakeOwner(), CountingClient()
        session = fake_session(owner, client, max_num_seqs=4)
        session.config.handover_drain_timeout = 0.05
        session.start()
        await until(lambda: session.healthy, "the handshake")
        long = tracked_request("long", 20, 100_000)
        session.add(long)
        await until(lambda: client.steps >= 2, "a few steps")
        session.assign("b:8000")
        await until(lambda: session.state.value == "assigned_elsewhere", "the hand-over")
        assert [t.gen.request_id for t in owner.moved] == ["long"]  # handed back: it moves
        snap = session.snapshot()
        assert (snap.losses, snap.last_loss, client.releases) == (0, "", 1)
        await session.stop()

    asyncio.run(main())


def test_given_back_during_the_drain_it_takes_work_again():
    async def main() -> None:
        owner, client = FakeOwner(), CountingClient()
        session = fake_session(owner, client, max_num_seqs=4)
        session.config.handover_drain_timeout = 0.05
        session.start()
        await until(lambda: session.healthy, "the handshake")
        session.add(tracked_request("long", 20, 100_000))
        await until(lambda: client.steps >= 2, "a few steps")
        session.assign("b:8000")
        session.assign("")  # back before the drain ends
        assert session.healthy
        await asyncio.sleep(0.15)  # past the drain: nothing moves
        assert owner.moved == [] and client.releases == 0 and session.healthy
        await session.stop()

    asyncio.run(main())
