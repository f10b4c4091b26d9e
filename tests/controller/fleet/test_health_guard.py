"""HealthMonitor.guard: a step in flight is abandoned the moment the session is judged lost, and
a cancellation from elsewhere (shutdown) stays a cancellation. Pure asyncio, no executor."""

from __future__ import annotations

import asyncio

import pytest

from controller.fleet.client import ExecutorLost
from controller.fleet.health import HealthMonitor


def monitor() -> HealthMonitor:
    woken: list[bool] = []
    m = HealthMonitor(
        client=None,
        interval=1.0,
        timeout=1.0,
        failures=1,  # type: ignore[arg-type]
        on_lost=lambda: woken.append(True),
    )
    m.woken = woken  # type: ignore[attr-defined]
    return m


def test_guard_returns_the_work_result() -> None:
    async def main() -> int:
        m = monitor()

        async def work() -> int:
            await asyncio.sleep(0)
            return 7

        return await m.guard(work())

    assert asyncio.run(main()) == 7


def test_a_lost_session_abandons_the_step_in_flight() -> None:
    async def main() -> None:
        m = monitor()
        cancelled = asyncio.Event()

        async def hung_step() -> None:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                cancelled.set()
                raise

        loop = asyncio.get_running_loop()
        loop.call_later(0.05, m.declare_lost, "no health answer")
        started = loop.time()
        with pytest.raises(ExecutorLost, match="no health answer"):
            await m.guard(hung_step())
        assert loop.time() - started < 5
        assert cancelled.is_set() and m.woken == [True]
        await asyncio.sleep(0.01)  # no cancellation left pending on this task
        assert asyncio.current_task().cancelling() == 0
        with pytest.raises(ExecutorLost):  # once lost, guarded work does not start
            await m.guard(hung_step())

    asyncio.run(main())


def test_a_shutdown_cancellation_stays_a_cancellation() -> None:
    async def main() -> None:
        m = monitor()

        async def loop_body() -> None:
            await m.guard(asyncio.sleep(3600))

        task = asyncio.create_task(loop_body())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

        both = asyncio.create_task(loop_body())  # lost and shut down at once: shutdown wins
        await asyncio.sleep(0.01)
        m.declare_lost("gone")
        both.cancel()
        with pytest.raises(asyncio.CancelledError):
            await both

    asyncio.run(main())


def test_losing_the_session_outside_a_guard_cancels_nothing() -> None:
    async def main() -> None:
        m = monitor()
        assert await m.guard(asyncio.sleep(0, result="sent")) == "sent"
        m.declare_lost("gone")  # between steps: nothing guarded
        await asyncio.sleep(0.01)  # this task is not cancelled
        with pytest.raises(ExecutorLost):
            m.check()

    asyncio.run(main())
