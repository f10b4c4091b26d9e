"""The stall guard: one watchdog timer per response cuts a send that waits past the timeout,
never a response whose sends each finish in time, and stops when the response is over."""

from __future__ import annotations

import asyncio
import time

import pytest

from controller.api.stall import ClientStalled, StallGuard, guarded


def test_a_send_waiting_past_the_timeout_is_cut_near_its_bound():
    async def main():
        sent = []

        async def send(message):
            sent.append(message)
            if message == "stuck":
                await asyncio.sleep(60)

        guard = StallGuard(send, 0.3)
        for _ in range(5):  # quick sends, spread over more than one timeout
            await guard("ok")
            await asyncio.sleep(0.1)
        start = time.monotonic()
        with pytest.raises(ClientStalled):
            await guard("stuck")
        took = time.monotonic() - start
        assert 0.29 <= took < 5.0  # generous: a loaded 2-core machine
        assert sent == ["ok"] * 5 + ["stuck"]
        assert not asyncio.current_task().cancelling()  # the cancel was taken back
        guard.close()

    asyncio.run(main())


def test_an_outside_cancel_stays_a_cancel_and_close_stops_the_watchdog():
    async def main():
        async def send(message):
            await asyncio.sleep(60)

        guard = StallGuard(send, 30.0)
        task = asyncio.create_task(guard("x"))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert guard._timer is not None
        guard.close()
        assert guard._timer is None

    asyncio.run(main())


def test_no_timeout_is_the_plain_send():
    async def send(message):
        pass

    assert guarded(send, 0) is send


def _watchdogs(loop) -> list:
    """The StallGuard timers still scheduled on `loop`."""
    return [
        h
        for h in loop._scheduled  # asyncio's timer heap: what a leaked watchdog would stay in
        if not h.cancelled() and getattr(h._callback, "__func__", None) is StallGuard._check
    ]


@pytest.mark.parametrize("kind", ["local", "forwarded"])
def test_a_streamed_response_stops_its_watchdog_however_it_ends(kind):
    """Both streamed responses (a local one and one passed back from a home controller) stop
    their watchdog when they end: a leaked one would fire every timeout for ever."""
    from controller.api.admission import Admission, AdmissionLimits
    from controller.api.forwarding import ProxiedResponse
    from controller.api.streaming import TicketedStream

    async def body():
        yield b"data: 1\n\n"

    class Upstream:  # what ProxiedResponse reads of the home's httpx response
        headers = {"content-type": "text/event-stream"}
        status_code = 200

        async def aiter_raw(self):
            yield b"data: 1\n\n"

        async def aclose(self):
            pass

    async def main():
        loop = asyncio.get_running_loop()
        if kind == "local":
            ticket = Admission(AdmissionLimits()).admit([4])
            response = TicketedStream(ticket, 30.0, None, body())
        else:
            response = ProxiedResponse(Upstream(), 30.0, lambda: None)
        sent = []

        async def send(message):
            sent.append(message["type"])

        async def receive():
            await asyncio.sleep(60)
            return {"type": "http.disconnect"}

        await response({"type": "http", "asgi": {"spec_version": "2.4"}}, receive, send)
        assert sent[0] == "http.response.start" and sent[-1] == "http.response.body"
        assert _watchdogs(loop) == []

    asyncio.run(main())
