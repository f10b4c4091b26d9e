"""Templated SSE chunks are byte for byte what the dict path writes; a step's merged delta says
what its tokens said one by one; the engine's sink puts deltas on the response's channel."""

from __future__ import annotations

import asyncio
import itertools
import json

import pytest

from common.wire.step_types import TokenLogprobs
from controller.api.deltas import DeltaQueue
from controller.api.formats import (
    ChatFormatter,
    Choice,
    CompletionFormatter,
    Prompt,
    ResponseMeta,
)
from controller.api.streaming import sse_line
from controller.core.outputs import OutputDelta, absorb, own_copy

TEXTS = ["", "a", " hello", 'q"uo\\te', "tab\tnl\n\r\x00\x1f", "é漢字🙂", "\ud800 lone", "</s>"]
BREAKS = ["ls\u2028ps\u2029nel\x85", "\x0b\x0c\x1c\x1d\x1e", "\u2028"]  # str.splitlines breaks
META = ResponseMeta(id='cmpl-"x\u00e9', created=1_700_000_000, model='m/é"odel')


class _Tok:
    """The formatters' tokenizer: only logprob texts would use it (none here)."""

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def _formatters(return_token_ids: bool):
    prompt = Prompt([1, 2, 3], "abc")
    yield CompletionFormatter(_Tok(), META, [prompt], 1, False, None, return_token_ids)
    yield ChatFormatter(_Tok(), META, prompt, False, return_token_ids)


def _deltas():
    for text, finished, ids in itertools.product(
        TEXTS + BREAKS, (False, True), ([], [7], [7, 8, 9])
    ):
        reason = "length" if finished else None
        yield OutputDelta("r", text=text, token_ids=ids, finished=finished, finish_reason=reason)


@pytest.mark.parametrize("return_token_ids", [False, True])
@pytest.mark.parametrize("include_usage", [False, True])
def test_templated_chunks_match_the_dict_path(return_token_ids, include_usage):
    for fmt in _formatters(return_token_ids):
        for index, first, d in itertools.product((0, 3), (False, True), _deltas()):
            choice = Choice(index=index, prompt_index=0)
            fast = fmt.stream_bytes(choice, d, first, include_usage)
            body = fmt.stream_chunk(choice, d, first, include_usage)
            assert fast is not None
            assert fast == (b"" if body is None else sse_line(body)), (type(fmt), d)


def test_every_event_is_one_line_for_a_splitlines_reader():
    """Text holding U+2028, U+2029 or U+0085 (JSON leaves them raw) is escaped, so a client
    that splits the stream with `str.splitlines` (httpx's `aiter_lines`) reads whole events
    that still decode to the same text; the dict path and the template agree."""
    for fmt in _formatters(False):
        for text in BREAKS:
            d = OutputDelta("r", text=text, token_ids=[7], finished=True, finish_reason="stop")
            choice = Choice(index=0, prompt_index=0)
            fast = fmt.stream_bytes(choice, d, False, False)
            assert fast == sse_line(fmt.stream_chunk(choice, d, False, False))
            lines = [x for x in fast.decode("utf-8").splitlines() if x]
            assert len(lines) == 1, lines
            body = json.loads(lines[0].removeprefix("data: "))
            (item,) = body["choices"]
            assert item.get("text", item.get("delta", {}).get("content")) == text
            assert item["finish_reason"] == "stop"
    event = sse_line({"error": {"message": "a\u2028b\x85"}}).decode("utf-8")
    assert len([x for x in event.splitlines() if x]) == 1


def test_logprobs_tools_and_echo_take_the_dict_path():
    prompt = Prompt([1, 2], "ab")
    d = OutputDelta("r", text="x", token_ids=[1])
    choice = Choice(index=0, prompt_index=0)
    with_lps = CompletionFormatter(_Tok(), META, [prompt], 1, False, 2)
    echo = CompletionFormatter(_Tok(), META, [prompt], 1, True, None)
    chat_lps = ChatFormatter(_Tok(), META, prompt, True)
    assert with_lps.stream_bytes(choice, d, False, False) is None
    assert echo.stream_bytes(choice, d, True, False) is None
    assert echo.stream_bytes(choice, d, False, False) is not None  # echo is the first only
    assert chat_lps.stream_bytes(choice, d, False, False) is None


def test_a_merged_step_says_what_its_tokens_said_one_by_one():
    """Several tokens coalesced into one delta give the same text, ids and logprobs as the
    token-by-token chunks, in one chunk."""
    parts = [("He", 1), ("llo", 2), (" wor", 3), ("ld", 4)]
    lp = [TokenLogprobs(token_id=t, logprob=-0.5 * t, rank=1) for _, t in parts]
    one_by_one = [
        OutputDelta("r", text=x, token_ids=[t], logprobs=[lp[k]]) for k, (x, t) in enumerate(parts)
    ]
    merged = own_copy(one_by_one[0])
    for d in one_by_one[1:]:
        absorb(merged, d)
    assert merged.text == "".join(d.text for d in one_by_one)
    assert merged.token_ids == [t for _, t in parts] and merged.logprobs == lp
    fmt = CompletionFormatter(_Tok(), META, [Prompt([1], None)], 1, False, 1)
    many = [fmt.stream_chunk(Choice(0, 0), d, False, False) for d in one_by_one]
    one = fmt.stream_chunk(Choice(0, 0), merged, False, False)
    text = "".join(c["choices"][0]["text"] for c in many)
    assert one["choices"][0]["text"] == text
    for key in ("tokens", "token_logprobs", "top_logprobs"):
        joined = [x for c in many for x in c["choices"][0]["logprobs"][key]]
        assert one["choices"][0]["logprobs"][key] == joined


def test_the_sink_tags_deltas_and_failures_with_the_sequence():
    async def main():
        q = DeltaQueue()
        a, b = q.sink(0), q.sink(1)
        a.put_nowait(OutputDelta("a", text="x", token_ids=[1]))
        b.put_nowait(OutputDelta("b", text="y", token_ids=[2], finished=True))
        a.put_nowait(OutputDelta("a", text="z", token_ids=[3], finished=True))
        boom = RuntimeError("boom")
        q.sink(2).put_nowait(boom)
        got = [await q.get() for _ in range(3)]
        assert [(i, d.text) for i, d in got[:2]] == [(0, "xz"), (1, "y")]
        assert got[2] == (2, boom)

    asyncio.run(main())
