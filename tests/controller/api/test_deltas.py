"""The channel between a response's sequences and its writer: merged while the writer lags,
in order, aborts after what is pending, the engine's lists untouched."""

from __future__ import annotations

import asyncio

from common.wire.step_types import TokenLogprobs
from controller.api.admission import ABORT
from controller.api.deltas import DeltaQueue
from controller.core.outputs import OutputDelta


def _delta(rid: str, text: str, ids: list[int], finished: bool = False) -> OutputDelta:
    lps = [TokenLogprobs(token_id=i, logprob=-1.0, rank=1) for i in ids]
    return OutputDelta(rid, text=text, token_ids=ids, logprobs=lps, finished=finished)


def test_a_lagging_writer_gets_one_merged_delta_per_sequence():
    async def main():
        q = DeltaQueue()
        engine_ids = [1]
        first = OutputDelta("a", text="x", token_ids=engine_ids)
        q.put_nowait((0, first))
        for k in range(100):
            q.put_nowait((0, _delta("a", "y", [k + 2])))
        q.put_nowait((1, _delta("b", "z", [9], finished=True)))
        assert q.pending == 2
        i, d = await q.get()
        assert i == 0 and d.text == "x" + "y" * 100 and d.token_ids == [1, *range(2, 102)]
        assert len(d.logprobs) == 100
        assert engine_ids == [1] and first.text == "x"  # the engine's delta is not grown
        i, d = await q.get()
        assert i == 1 and d.finished and d.text == "z"
        assert q.pending == 0

    asyncio.run(main())


def test_failure_after_output_and_abort_after_pending():
    async def main():
        q = DeltaQueue()
        q.put_nowait((0, _delta("a", "x", [1])))
        boom = RuntimeError("boom")
        q.put_nowait((0, boom))
        q.put_nowait((None, ABORT))
        assert q.aborted
        assert (await q.get())[1].text == "x"
        assert (await q.get())[1] is boom
        assert await q.get() == (None, ABORT)
        assert await q.get() == (None, ABORT)  # stays aborted

    asyncio.run(main())


def test_get_waits_for_output_and_abort_wakes_waiters():
    async def main():
        q = DeltaQueue()
        getter = asyncio.create_task(q.get())
        waiter = asyncio.create_task(q.wait_aborted())
        await asyncio.sleep(0.01)
        assert not getter.done() and not waiter.done()
        q.put_nowait((2, _delta("c", "w", [3])))
        assert (await getter)[0] == 2
        assert not waiter.done()
        q.put_nowait((None, ABORT))
        await asyncio.wait_for(waiter, 1)

    asyncio.run(main())
