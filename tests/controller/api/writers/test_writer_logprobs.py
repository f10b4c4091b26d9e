"""Handed-off streams with logprobs (completions' `logprobs`, chat's `logprobs` and
`top_logprobs`), completions' echo and chat's tool calls: the STEPs carry each token's logprob
and alternatives, and the writer writes byte for byte what the in-process path writes for the
same steps (its formatter's `stream_bytes`, else `stream_chunk`, framed as direct_write.py
frames a chunk; tool-call ids, random, aside)."""

from __future__ import annotations

import random
import re
from array import array

import pytest

from common.wire.step_types import TokenLogprobs
from controller.api.choice import Choice
from controller.api.formats import ChatFormatter, CompletionFormatter, Prompt
from controller.api.sse import sse_line
from controller.api.tool_output import ToolPolicy
from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.core.outputs import OutputDelta
from controller.text.detokenizer import OutputTextState
from controller.text.tokenizer import Tokenizer
from controller.text.tools.smollm2 import SmolLM2Format
from tests.controller.api.writers.test_writer import (
    META,
    MODEL_DIR,
    _read_all,
    _steps,
    _threaded_writer,
)

DONE = b"data: [DONE]\n\n"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def _f32(x: float) -> float:
    """A float the executors can send (their logprobs are float32 on the wire)."""
    return array("f", [x])[0]


def _logprobs(rng: random.Random, ids: list[int], k: int, vocab: int) -> list[TokenLogprobs]:
    out = []
    for token in ids:
        top = [rng.randrange(vocab) for _ in range(k)]
        values = sorted((_f32(-rng.random() * 9) for _ in range(k)), reverse=True)
        out.append(TokenLogprobs(token, _f32(-rng.random() * 5), 1, top, values))
    return out


def _framed(line: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(line), line)


def _in_process(fmt, tok, steps, lps, reasons, stop, usage: bool) -> bytes:
    """What sse_events writes for one sequence's deltas (after the prelude)."""
    state, choice, out = OutputTextState(tok, stop=stop), Choice(0, 0), b""
    for ids, lp, reason in zip(steps, lps, reasons):
        text, stopped = state.update(ids, reason is not None)
        if stopped and reason is None:
            reason = "stop"
        d = OutputDelta("r", text, ids, lp, None, reason is not None, reason)
        first = not choice.started  # as sse_events reads it
        choice.add(d)
        line = fmt.stream_bytes(choice, d, first, usage)
        if line is None:
            body = fmt.stream_chunk(choice, d, first, usage)
            line = b"".join(_framed(sse_line(p)) for p in ([body] if body else []))
        elif line:
            line = _framed(line)
        out += line
        if reason is not None:
            break
    if usage:
        out += _framed(sse_line(fmt.usage_chunk([choice])))
    return out + _framed(DONE)


def _formatter(tok, kind: str, top: int, echo: str | None, return_token_ids: bool):
    if kind == "chat":
        return ChatFormatter(tok, META, Prompt([1, 2, 3], "abc"), True, return_token_ids)
    prompt = Prompt([1, 2, 3], echo)
    return CompletionFormatter(
        tok, META, [prompt], 1, echo is not None, None if top < 0 else top, return_token_ids
    )


CASES = [
    ("completion", 3, None, False),
    ("completion", 0, None, True),
    ("completion", -1, "Écho: the prompt ", False),  # echo alone
    ("completion", -1, "Écho ", True),
    ("chat", 5, None, False),
    ("chat", 0, None, True),
]


@pytest.mark.parametrize("kind, top, echo, return_token_ids", CASES)
@pytest.mark.parametrize("usage", [False, True])
def test_bytes_equal_the_in_process_path(tok, kind, top, echo, return_token_ids, usage):
    core, thread = _threaded_writer(tok)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    rng = random.Random(hash((kind, top, usage)) & 0xFFFF)
    streams = {}
    for slot in (1, 2, 3):
        meta = StreamMeta(META.id, obj, META.created, META.model, kind, [50 + slot])
        meta.return_token_ids, meta.include_usage = return_token_ids, usage
        meta.prompt_tokens = 3  # the formatter's prompt's
        meta.logprobs = top >= 0
        meta.echo = [echo] if echo is not None else []
        meta.stop = ["stop here"] if slot == 2 else []
        steps = _steps(tok, slot)
        lps = [_logprobs(rng, ids, top, 49152) if top >= 0 else None for ids in steps]
        reasons = [None] * (len(steps) - 1) + ["length"]
        streams[slot] = (core.open(slot, meta), steps, lps, reasons, meta.stop)
    for k in range(max(len(s[1]) for s in streams.values())):
        builder = fr.StepBuilder()
        for slot, (_, steps, lps, reasons, _) in streams.items():
            if k < len(steps):
                builder.add(50 + slot, steps[k], reasons[k], lps[k])
        core.step(builder)
    for client, steps, lps, reasons, stop in streams.values():
        fmt = _formatter(tok, kind, top, echo, return_token_ids)
        want = _in_process(fmt, tok, steps, lps, reasons, stop, usage)
        assert _read_all(client) == want
    want = sorted([(fr.STOPPED, 52, 0)] + [(fr.DONE, s, 0) for s in (1, 2, 3)])
    assert sorted(core.replies(4)) == want
    core.control.close()
    thread.join(10)
    assert not thread.is_alive()


def test_an_aborted_echo_stream_ends_as_in_process(tok):
    """Shutdown before any token: the "abort" chunk of an echoing completion carries the
    prompt, as in process (its first delta)."""
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [9])
    meta.echo = ["the prompt"]
    client = core.open(1, meta)
    core.control.send(fr.encode_control(fr.CLOSE, 1, fr.END_ABORTED))
    fmt = _formatter(tok, "completion", -1, "the prompt", False)
    d = OutputDelta("r", finished=True, finish_reason="abort")
    body = fmt.stream_chunk(Choice(0, 0), d, True, False)
    assert _read_all(client) == _framed(sse_line(body)) + _framed(DONE)
    assert core.replies(1) == [(fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


CALLS = (
    'Checking.<tool_call>[{"name": "get_weather", "arguments": {"city":"Paris"}}, '
    '{"name": "noop", "arguments": {}}]</tool_call> done'
)


def _mask_ids(body: bytes) -> bytes:
    """Tool-call ids are random: the same length, masked, so the framing still compares."""
    return re.sub(rb"call_[A-Za-z0-9]{24}", b"call_" + b"X" * 24, body)


@pytest.mark.parametrize("max_calls", [None, 1])
@pytest.mark.parametrize("logprobs", [False, True])
def test_tool_call_streams_equal_the_in_process_path(tok, max_calls, logprobs):
    """Chat with tools: the writer reads the output for calls with the same ToolStream (its
    format rebuilt by name) and writes the same chunks, ids aside."""
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "chat.completion.chunk", META.created, META.model, "chat", [77])
    meta.tool_parser, meta.tool_max_calls, meta.logprobs = "smollm2", max_calls, logprobs
    client = core.open(1, meta)
    ids = tok.backend.encode(CALLS, add_special_tokens=False).ids
    rng, steps, at = random.Random(7), [], 0
    while at < len(ids):
        k = rng.choice([1, 2, 3])
        steps.append(ids[at : at + k])
        at += k
    lps = [_logprobs(rng, s, 2, 49152) if logprobs else None for s in steps]
    reasons = [None] * (len(steps) - 1) + ["stop"]
    for step, lp, reason in zip(steps, lps, reasons):
        builder = fr.StepBuilder()
        builder.add(77, step, reason, lp)
        core.step(builder)
    policy = ToolPolicy(SmolLM2Format(), max_calls)
    fmt = ChatFormatter(tok, META, Prompt([1, 2, 3], "abc"), logprobs, False, policy)
    want = _in_process_chunks(fmt, tok, steps, lps, reasons)
    got = _read_all(client)
    assert b"tool_calls" in got
    assert _mask_ids(got) == _mask_ids(want)
    assert core.replies(1) == [(fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


def _in_process_chunks(fmt, tok, steps, lps, reasons) -> bytes:
    """sse_events' chunks for a formatter whose `stream_chunk` may give several per delta."""
    state, choice, out = OutputTextState(tok), Choice(0, 0), b""
    for ids, lp, reason in zip(steps, lps, reasons):
        text, _ = state.update(ids, reason is not None)
        d = OutputDelta("r", text, ids, lp, None, reason is not None, reason)
        first = not choice.started  # as sse_events reads it
        choice.add(d)
        body = fmt.stream_chunk(choice, d, first, False)
        for part in [body] if isinstance(body, dict) else body or []:
            out += _framed(sse_line(part))
    return out + _framed(DONE)
