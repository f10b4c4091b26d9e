"""How the engine hands a request's deltas to its API handler (controller.tracked.deliver)."""

from __future__ import annotations

import asyncio

from common.step_types import SamplingParams, TokenLogprobs
from controller.outputs import GenerationRequest, OutputDelta, absorb
from controller.tracked import Tracked, deliver


def _tracked(stream: bool) -> Tracked:
    gen = GenerationRequest("r", [1, 2], SamplingParams(), max_tokens=8, stream=stream)
    return Tracked(gen=gen, queue=asyncio.Queue(), text=None, request=None, arrival=0.0)


def _delta(i: int, finished: bool = False) -> OutputDelta:
    return OutputDelta("r", text=f"t{i} ", token_ids=[i], num_output_tokens=i + 1,
                       logprobs=[TokenLogprobs(i, -0.5, 1)], finished=finished,
                       finish_reason="length" if finished else None)


def _drain(queue: asyncio.Queue) -> list[OutputDelta]:
    items = []
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


def test_streamed_requests_get_every_delta():
    tracked = _tracked(stream=True)
    for i in range(4):
        deliver(tracked, _delta(i, finished=i == 3))
    assert [d.token_ids for d in _drain(tracked.queue)] == [[0], [1], [2], [3]]


def test_non_streamed_requests_get_the_first_delta_then_one_at_the_end():
    tracked = _tracked(stream=False)
    for i in range(5):
        deliver(tracked, _delta(i, finished=i == 4))
        if i == 2:  # the first delta went out at once (it ends the queued time); then nothing
            assert [d.token_ids for d in _drain(tracked.queue)] == [[0]]
    (last,) = _drain(tracked.queue)
    assert last.token_ids == [1, 2, 3, 4] and last.text == "t1 t2 t3 t4 "
    assert [lp.token_id for lp in last.logprobs] == [1, 2, 3, 4]
    assert last.finished and last.finish_reason == "length" and last.num_output_tokens == 5
    assert tracked.held is None


def test_absorb_keeps_absent_logprobs_absent():
    a = OutputDelta("r", text="a", token_ids=[1])
    absorb(a, OutputDelta("r", text="b", token_ids=[2], finished=True, finish_reason="stop"))
    assert a.logprobs is None and a.prompt_logprobs is None
    assert (a.text, a.token_ids, a.finished, a.finish_reason) == ("ab", [1, 2], True, "stop")
    absorb(a, OutputDelta("r", prompt_logprobs=[TokenLogprobs(3, -1.0, 2)]))
    assert [lp.token_id for lp in a.prompt_logprobs] == [3]
