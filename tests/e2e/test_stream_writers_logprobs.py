"""Streams with logprobs (completions' `logprobs`, chat's `logprobs`/`top_logprobs`) and
completions' echo go through a stream writer (--stream-writers 1) and read as from the
in-process path (a second server without writers, on its own simulated executor: greedy tokens
and their simulated logprobs are a function of the prompt and position). Compared over the
whole stream (texts joined, logprobs concatenated): the in-process path may merge the deltas of
a response whose task fell behind, the writer writes one chunk per step."""

from __future__ import annotations

from tests.e2e import test_stream_writers as base
from tests.e2e.helpers import assert_no_blocks_in_use
from tests.e2e.test_stream_writers import PROMPT, _streams

writer_server = base.writer_server  # the same servers' setup (started for this module)
plain_server = base.plain_server


def _completion(server, **kw) -> dict:
    stream = server.client().completions.create(
        model=server.model_name, prompt=PROMPT, temperature=0, stream=True, max_tokens=30, **kw
    )
    text, lps, reasons = "", {"tokens": [], "token_logprobs": [], "top_logprobs": []}, []
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        reasons.append(choice.finish_reason)
        if choice.logprobs is not None:
            for key in lps:
                lps[key] += getattr(choice.logprobs, key)
    return {"text": text, "logprobs": lps, "finish": reasons[-1]}


def _chat(server, **kw) -> dict:
    stream = server.client().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=20,
        temperature=0,
        stream=True,
        **kw,
    )
    text, content, reasons = "", [], []
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.delta.content or ""
        reasons.append(choice.finish_reason)
        if choice.logprobs is not None:
            content += [c.model_dump() for c in choice.logprobs.content or []]
    return {"text": text, "content": content, "finish": reasons[-1]}


def test_completion_logprobs_and_echo(writer_server, plain_server):
    s, plain = writer_server, plain_server
    for kw in ({"logprobs": 3}, {"logprobs": 0}, {"echo": True}):
        written = _streams(s, "finished")
        via_writer = _completion(s, **kw)
        assert _streams(s, "finished") == written + 1, f"{kw}: the stream was not a writer's"
        assert via_writer == _completion(plain, **kw), kw
        assert via_writer["finish"] == "length"
        if "logprobs" in kw:  # one entry per token, its alternatives with the token itself
            assert len(via_writer["logprobs"]["token_logprobs"]) == 30
            assert all(len(top) >= 1 for top in via_writer["logprobs"]["top_logprobs"])
    assert_no_blocks_in_use(s)


def test_chat_logprobs(writer_server, plain_server):
    s, plain = writer_server, plain_server
    for kw in ({"logprobs": True}, {"logprobs": True, "top_logprobs": 4}):
        written = _streams(s, "finished")
        via_writer = _chat(s, **kw)
        assert _streams(s, "finished") == written + 1, f"{kw}: the stream was not a writer's"
        assert via_writer == _chat(plain, **kw), kw
        assert len(via_writer["content"]) == 20
        assert all(
            len(c["top_logprobs"]) == kw.get("top_logprobs", 0) for c in via_writer["content"]
        )
    assert_no_blocks_in_use(s)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]


def test_chat_with_tools(writer_server, plain_server):
    """A chat stream with tools (its output read for calls, here plain text: the simulated
    executor writes no call) goes through the writer and reads as in process."""
    s, plain = writer_server, plain_server
    for kw in ({"tools": TOOLS}, {"tools": TOOLS, "parallel_tool_calls": False}):
        written = _streams(s, "finished")
        via_writer = _chat(s, **kw)
        assert _streams(s, "finished") == written + 1, f"{kw}: the stream was not a writer's"
        assert via_writer == _chat(plain, **kw), kw
        assert via_writer["text"] and via_writer["finish"] == "length"
    assert_no_blocks_in_use(s)
