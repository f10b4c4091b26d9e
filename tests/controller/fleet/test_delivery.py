"""How the engine hands a request's deltas to its API handler (controller.fleet.tracked.deliver)."""

from __future__ import annotations

import asyncio

from common.wire.step_types import SamplingParams, TokenLogprobs
from controller.core.outputs import GenerationRequest, OutputDelta, absorb
from controller.fleet.tracked import Tracked, deliver


def _tracked(stream: bool) -> Tracked:
    gen = GenerationRequest("r", [1, 2], SamplingParams(), max_tokens=8, stream=stream)
    return Tracked(gen=gen, queue=asyncio.Queue(), text=None, request=None, arrival=0.0)


def _delta(i: int, finished: bool = False) -> OutputDelta:
    return OutputDelta(
        "r",
        text=f"t{i} ",
        token_ids=[i],
        num_output_tokens=i + 1,
        logprobs=[TokenLogprobs(i, -0.5, 1)],
        finished=finished,
        finish_reason="length" if finished else None,
    )


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


def test_a_quiet_request_builds_no_delta_per_step_and_ends_with_all_its_tokens():
    """Non-streamed, no stop string, no logprobs: after the first delta, steps only count the
    tokens; the last delta carries every one since, across a move to another executor."""
    import os

    import pytest

    from controller.core.request import Request
    from controller.core.scheduler_base import RequestUpdate
    from controller.fleet.tracked import hold_quietly, make_delta
    from controller.text.detokenizer import OutputTextState
    from controller.text.tokenizer import Tokenizer

    model = os.path.expanduser(
        os.environ.get("TANDEM_MODEL_DIR", "~/.cache/tandem/models/SmolLM2-135M-Instruct")
    )
    if not os.path.isfile(os.path.join(model, "tokenizer.json")):
        pytest.skip("no model directory")
    tok = Tokenizer.from_model_dir(model)
    ids = tok.encode("The quick brown fox jumps over the lazy dog again and again")
    gen = GenerationRequest("q", [1, 2], SamplingParams(), max_tokens=64, stream=False)
    tracked = Tracked(
        gen=gen,
        queue=asyncio.Queue(),
        arrival=0.0,
        text=OutputTextState(tok, defer=True),
        request=Request("q", [1, 2], SamplingParams(), max_tokens=64),
    )

    def step(token: int, finished: bool = False) -> None:
        tracked.request.output_token_ids.append(token)
        update = RequestUpdate(
            "q", [token], finished=finished, finish_reason="length" if finished else None
        )
        if not hold_quietly(tracked, update):
            deliver(tracked, make_delta(tracked, update))

    step(ids[0])
    assert tracked.quiet and len(_drain(tracked.queue)) == 1
    for token in ids[1:5]:
        step(token)
    assert tracked.queue.empty() and tracked.unsent_tokens == 4 and tracked.held is None
    # A move: the new executor's request resumes from the output so far.
    moved = Request("q", [1, 2], SamplingParams(), max_tokens=64)
    moved.output_token_ids = list(tracked.request.output_token_ids)
    tracked.request = moved
    for token in ids[5:-1]:
        step(token)
    step(ids[-1], finished=True)
    (last,) = _drain(tracked.queue)
    assert last.token_ids == ids[1:] and last.finished and last.finish_reason == "length"
    assert last.text == tok.decode(ids)  # the first delta had no text: decoded once, at the end
    assert tracked.unsent_tokens == 0


def test_requests_with_logprobs_or_streams_are_never_quiet():
    streamed = _tracked(stream=True)
    deliver(streamed, _delta(0))
    assert not streamed.quiet
    gen = GenerationRequest("r", [1, 2], SamplingParams(logprobs=1), max_tokens=8, stream=False)
    with_lp = Tracked(gen=gen, queue=asyncio.Queue(), text=None, request=None, arrival=0.0)
    deliver(with_lp, _delta(0))
    assert not with_lp.quiet
