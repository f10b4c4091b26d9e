"""Waiting for an executor is admitted like any other queueing: a waiting request counts
against --max-queued-requests (429 beyond it), gets 503 after the fleet's timeout or at
shutdown, and holds nothing afterwards. In-process, over a fake engine without executors."""

from __future__ import annotations

import asyncio

from controller.api.admission import Admission, AdmissionLimits
from tests.controller.api.test_request_ids import COMPLETION, FakeEngine, client, make_app


class NoExecutorEngine(FakeEngine):
    """No executor is healthy until `up` is set; waits end after `timeout` seconds."""

    def __init__(self, timeout: float):
        super().__init__()
        self.healthy = False
        self.up = asyncio.Event()
        self.timeout = timeout

    async def wait_for_executor(self) -> bool:
        try:
            await asyncio.wait_for(self.up.wait(), self.timeout)
        except TimeoutError:
            return False
        self.healthy = True
        return True

    def no_executor_message(self) -> str:
        return "No healthy executor is available."


def test_waiting_requests_count_against_the_queue_bound():
    engine = NoExecutorEngine(timeout=30)
    admission = Admission(AdmissionLimits(max_queued_requests=2))

    async def main():
        async with client(make_app(engine, admission)) as http:
            waiting = [asyncio.create_task(http.post("/v1/completions", json=COMPLETION))]
            waiting.append(asyncio.create_task(http.post("/v1/completions", json=COMPLETION)))
            while admission.queued_requests < 2:
                await asyncio.sleep(0.01)
            refused = await http.post("/v1/completions", json=COMPLETION)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
            assert admission.active == 2
            engine.up.set()
            done = await asyncio.gather(*waiting)
            assert [r.status_code for r in done] == [200, 200]

    asyncio.run(main())
    assert (admission.queued_requests, admission.active) == (0, 0)


def test_no_executor_in_time_is_503_and_releases_the_queue():
    engine = NoExecutorEngine(timeout=0.2)
    admission = Admission(AdmissionLimits(max_queued_requests=4))

    async def main():
        async with client(make_app(engine, admission)) as http:
            for body in (COMPLETION, {**COMPLETION, "stream": True}):
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 503
                assert r.json()["error"]["code"] == "no_healthy_executor"

    asyncio.run(main())
    assert (admission.queued_requests, admission.active) == (0, 0)
    assert engine.seen == []  # nothing reached the engine


def test_shutdown_ends_the_wait():
    engine = NoExecutorEngine(timeout=60)
    admission = Admission(AdmissionLimits())

    async def main():
        async with client(make_app(engine, admission)) as http:
            waiting = asyncio.create_task(http.post("/v1/completions", json=COMPLETION))
            while admission.active < 1:
                await asyncio.sleep(0.01)
            admission.start_draining()
            assert admission.abort_all() == 1
            r = await asyncio.wait_for(waiting, 5)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down"

    asyncio.run(main())
    assert (admission.queued_requests, admission.active) == (0, 0)
