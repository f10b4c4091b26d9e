"""A request fails alone, whatever it carries: one whose data cannot be put on the wire, one
whose output cannot be made, one the executor fails. Each ends with an error to its client,
the session is never lost, the executor never sees what it could not take, and the other
requests finish as if it had not been there. Without a model or a process: the session runs
its real lifecycle and step loop against a fake executor client."""

from __future__ import annotations

import asyncio

from common.wire.step_types import SamplingParams
from controller.core.outputs import OutputDelta
from controller.fleet.session import ExecutorSession
from controller.fleet.tracked import Tracked
from tests.controller.core.harness import expected_output
from tests.controller.fleet.fakes import (
    FakeClient,
    FakeOwner,
    LenientExecutor,
    fake_session,
    tracked_request,
    until,
)


async def _start() -> tuple[ExecutorSession, FakeClient, FakeOwner]:
    client = FakeClient(LenientExecutor)
    session, owner = fake_session(client, max_num_seqs=8)
    session.start()
    await until(lambda: session.healthy, "the handshake")
    return session, client, owner


def _deltas(tracked: Tracked) -> list[OutputDelta]:
    items = []
    while not tracked.queue.empty():
        items.append(tracked.queue.get_nowait())
    return items


def _check_innocents(innocents: list[Tracked]) -> None:
    """Each innocent request got its whole greedy output and no error."""
    for t in innocents:
        deltas = _deltas(t)
        assert deltas[-1].finish_reason == "length" and not any(d.error for d in deltas)
        tokens = [tok for d in deltas for tok in d.token_ids]
        assert tokens == expected_output(t.gen.prompt_token_ids, t.gen.max_tokens)


def test_a_request_that_cannot_be_sent_fails_alone():
    async def main() -> None:
        session, client, owner = await _start()
        innocents = [tracked_request(f"ok{i}", 20 + i, 6) for i in range(3)]
        poison = tracked_request("poison", 20, 6, SamplingParams(seed=2**63))  # not an int64
        for t in [innocents[0], poison, *innocents[1:]]:  # all admitted in one step
            session.add(t)
        await until(lambda: len(owner.done) == 4, "every request")
        last = _deltas(poison)[-1]
        assert last.finished and last.finish_reason == "error"
        assert "cannot be sent to an executor" in last.error and "out of range" in last.error
        _check_innocents(innocents)
        sent_ids = {
            r.request_id
            for step in client.all_sent
            for r in step.new_requests + step.cached_requests
        }
        assert "poison" not in sent_ids  # the executor never saw it
        snap = session.snapshot()
        assert (snap.losses, snap.state, snap.used_blocks, snap.requests) == (0, "healthy", 0, 0)
        await session.stop()

    asyncio.run(main())


def test_a_step_of_only_unsendable_requests_is_sent_empty_and_the_session_goes_on():
    async def main() -> None:
        session, client, owner = await _start()
        poison = tracked_request("poison", 20, 6, SamplingParams(seed=-(2**63) - 1))
        session.add(poison)
        await until(lambda: len(owner.done) == 1, "the poison's end")
        assert _deltas(poison)[-1].finish_reason == "error"
        later = tracked_request("later", 12, 4)
        session.add(later)
        await until(lambda: len(owner.done) == 2, "the next request")
        _check_innocents([later])
        assert session.snapshot().losses == 0
        await session.stop()

    asyncio.run(main())


class _BrokenText:
    """A detokenizer that fails (as a bug on some input would)."""

    deferred = False

    def update(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        raise RuntimeError("detokenizer bug")


def test_a_request_whose_output_fails_fails_alone():
    async def main() -> None:
        session, client, owner = await _start()
        innocents = [tracked_request(f"ok{i}", 16, 5) for i in range(2)]
        broken = tracked_request("broken", 16, 5)
        broken.text = _BrokenText()
        for t in [innocents[0], broken, innocents[1]]:
            session.add(t)
        await until(lambda: len(owner.done) == 3, "every request")
        last = _deltas(broken)[-1]
        assert last.finish_reason == "error" and "detokenizer bug" in last.error
        _check_innocents(innocents)
        snap = session.snapshot()
        assert (snap.losses, snap.used_blocks, snap.requests) == (0, 0, 0)
        await session.stop()

    asyncio.run(main())


def test_a_request_the_executor_fails_fails_alone():
    async def main() -> None:
        session, client, owner = await _start()
        client.executor.fail.add("refused")
        innocents = [tracked_request(f"ok{i}", 18, 5) for i in range(2)]
        refused = tracked_request("refused", 18, 5)
        for t in [innocents[0], refused, innocents[1]]:
            session.add(t)
        await until(lambda: len(owner.done) == 3, "every request")
        last = _deltas(refused)[-1]
        assert last.finish_reason == "error" and last.error == "device says no"
        _check_innocents(innocents)
        assert session.snapshot().losses == 0
        await session.stop()

    asyncio.run(main())
