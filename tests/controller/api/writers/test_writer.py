"""A stream writer, fed step frames over a real SEQPACKET socket pair with the client's socket
passed by SCM_RIGHTS, writes byte for byte what the in-process streaming path writes for the
same steps (its detokenizer, `stream_bytes` and direct_write.py's chunk framing); it tells the
core when a stream ends, when a stop string ends a sequence and when the client is gone."""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from controller.api.choice import Choice
from controller.api.formats import ChatFormatter, CompletionFormatter, Prompt, ResponseMeta
from controller.api.streaming import sse_line
from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.api.writers.worker import Writer
from controller.core.outputs import OutputDelta
from controller.text.detokenizer import OutputTextState
from controller.text.tokenizer import Tokenizer

MODEL_DIR = Path(
    os.environ.get("TANDEM_MODEL_DIR", "/root/.cache/tandem/models/SmolLM2-135M-Instruct")
)
if not (MODEL_DIR / "tokenizer.json").is_file():
    pytest.skip(f"model directory {MODEL_DIR} not found", allow_module_level=True)

META = ResponseMeta(id='cmpl-"é', created=1_700_000_000, model="m/é")
TEXT = "Hello, world! Ünïcödé 漢字 🙂 and a stop here. The end.\n\tTabs"


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def _steps(tok: Tokenizer, seed: int) -> list[list[int]]:
    """The text's ids, cut into steps of 1-3 tokens (and some empty ones)."""
    ids = tok.backend.encode(TEXT, add_special_tokens=False).ids + tok.eos_token_ids[:1]
    rng, steps, at = random.Random(seed), [], 0
    while at < len(ids):
        k = rng.choice([0, 1, 1, 2, 3])
        steps.append(ids[at : at + k])
        at += k
    return steps


def _formatter(tok: Tokenizer, kind: str, return_token_ids: bool):
    prompt = Prompt([1, 2, 3], "abc")
    if kind == "chat":
        return ChatFormatter(tok, META, prompt, False, return_token_ids)
    return CompletionFormatter(tok, META, [prompt], 1, False, None, return_token_ids)


def _in_process(
    tok, kind, steps, reasons, stop, return_token_ids, include_usage, cached=0
) -> bytes:
    """What the in-process path writes for one sequence's steps (the chunks after the head and
    prelude, the usage chunk and [DONE] included, the terminating zero-length chunk
    excluded)."""
    fmt = _formatter(tok, kind, return_token_ids)
    state = OutputTextState(tok, stop=stop)
    choice, out = Choice(index=0, prompt_index=0), b""
    for ids, reason in zip(steps, reasons):
        text, stopped = state.update(ids, reason is not None)
        if stopped and reason is None:
            reason = "stop"
        d = OutputDelta(
            "r",
            text,
            ids,
            finished=reason is not None,
            finish_reason=reason,
            num_cached_tokens=cached,
        )
        line = fmt.stream_bytes(choice, d, not choice.started, include_usage)
        choice.add(d)
        if line:
            out += b"%x\r\n%b\r\n" % (len(line), line)
        if reason is not None:
            break
    if include_usage:
        line = sse_line(fmt.usage_chunk([choice]))
        out += b"%x\r\n%b\r\n" % (len(line), line)
    return out + b"%x\r\n%b\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")


class _Core:
    """The core's end of a writer: its control socket, and a client connection per stream."""

    def __init__(self, control: socket.socket):
        self.control = control

    def open(self, slot: int, meta: StreamMeta) -> socket.socket:
        ours, client = socket.socketpair()
        socket.send_fds(self.control, [fr.encode_open(slot, meta.to_json())], [ours.fileno()])
        ours.close()  # the core keeps its fd in the real path; here the client sees EOF
        return client

    def step(self, builder: fr.StepBuilder) -> None:
        self.control.send(builder.take())

    def replies(self, count: int) -> list[tuple[int, int, int]]:
        self.control.settimeout(20)
        return [fr.decode_head(self.control.recv(64)) for _ in range(count)]


def _threaded_writer(tok: Tokenizer, stall: float = 0.0):
    core_end, writer_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    writer = Writer(writer_end, tok, stall)
    thread = threading.Thread(target=writer.run, daemon=True)
    thread.start()
    return _Core(core_end), thread


def _read_all(client: socket.socket) -> bytes:
    client.settimeout(20)
    out = b""
    while chunk := client.recv(65536):
        out += chunk
    return out


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("return_token_ids", [False, True])
def test_bytes_equal_the_in_process_path(tok, kind, return_token_ids):
    core, thread = _threaded_writer(tok)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    streams = {}
    for slot, seed in [(1, 0), (2, 1), (3, 2)]:
        meta = StreamMeta(META.id, obj, META.created, META.model, kind, [100 + slot])
        meta.return_token_ids = return_token_ids
        steps = _steps(tok, seed)
        reasons = [None] * (len(steps) - 1) + ["stop"]
        streams[slot] = (core.open(slot, meta), steps, reasons)
    for k in range(max(len(s[1]) for s in streams.values())):
        builder = fr.StepBuilder()
        for slot, (_, steps, reasons) in streams.items():
            if k < len(steps):
                builder.add(100 + slot, steps[k], reasons[k])
        core.step(builder)
    for client, steps, reasons in streams.values():
        want = _in_process(tok, kind, steps, reasons, [], return_token_ids, False)
        assert _read_all(client) == want
    done = core.replies(3)
    assert sorted(done) == [(fr.DONE, s, 0) for s in (1, 2, 3)]
    core.control.close()
    thread.join(10)
    assert not thread.is_alive()


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_the_usage_chunk(tok, kind):
    core, thread = _threaded_writer(tok)
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    meta = StreamMeta(META.id, obj, META.created, META.model, kind, [11])
    meta.include_usage, meta.prompt_tokens = True, 3  # the formatter's prompt: 3 tokens
    client = core.open(1, meta)
    steps = _steps(tok, 5)
    reasons = [None] * (len(steps) - 1) + ["length"]
    core.control.send(fr.encode_control(fr.USAGE, 11, 2))
    for ids, reason in zip(steps, reasons):
        builder = fr.StepBuilder()
        builder.add(11, ids, reason)
        core.step(builder)
    want = _in_process(tok, kind, steps, reasons, [], False, True, cached=2)
    assert _read_all(client) == want
    assert core.replies(1) == [(fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


@pytest.mark.parametrize("usage", [False, True])
def test_an_aborted_response_ends_as_in_process(tok, usage):
    """CLOSE with END_ABORTED (shutdown): each unfinished sequence's "abort" chunk, held-back
    text not flushed, the usage chunk, [DONE], as sse_events writes an aborted response."""
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [21])
    meta.include_usage, meta.prompt_tokens, meta.stop = usage, 3, ["stop here"]
    client = core.open(1, meta)
    steps = _steps(tok, 6)[:6]
    for ids in steps:
        builder = fr.StepBuilder()
        builder.add(21, ids)
        core.step(builder)
    core.control.send(fr.encode_control(fr.CLOSE, 1, fr.END_ABORTED))
    # In process: the steps' deltas, then an empty "abort" delta (no held-back text).
    fmt = _formatter(tok, "completion", False)
    state, choice, want = OutputTextState(tok, stop=["stop here"]), Choice(0, 0), b""
    deltas = [OutputDelta("r", state.update(ids, False)[0], ids) for ids in steps]
    deltas.append(OutputDelta("r", finished=True, finish_reason="abort"))
    for d in deltas:
        line = fmt.stream_bytes(choice, d, not choice.started, usage)
        choice.add(d)
        if line:
            want += b"%x\r\n%b\r\n" % (len(line), line)
    if usage:
        line = sse_line(fmt.usage_chunk([choice]))
        want += b"%x\r\n%b\r\n" % (len(line), line)
    want += b"%x\r\n%b\r\n" % (len(b"data: [DONE]\n\n"), b"data: [DONE]\n\n")
    assert _read_all(client) == want
    assert core.replies(1) == [(fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


def test_an_error_ends_its_sequence_with_the_error_event(tok):
    """Two sequences: one fails (ERROR: its event, no last chunk), the other goes on; [DONE]
    after both, as sse_events writes an error delta."""
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "text_completion", 0, "m", "completion", [31, 32])
    client = core.open(1, meta)
    event = b'data: {"error": {"message": "boom"}}\n\n'
    core.control.send(fr.encode_error(31, event))
    builder = fr.StepBuilder()
    builder.add(31, [5])  # after its error: dropped
    builder.add(32, tok.backend.encode(" hi").ids, "length")
    core.step(builder)
    got = _read_all(client)
    parts = got.split(b"\r\n")
    assert parts[1] == event
    assert b'"index": 1, "text": " hi"' in parts[3] and b'"finish_reason": "length"' in parts[3]
    assert parts[5] == b"data: [DONE]\n\n" and len(parts) == 7
    assert core.replies(1) == [(fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


def test_a_stop_string_ends_the_sequence_and_tells_the_core(tok):
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [7])
    meta.stop = ["stop here"]
    client = core.open(1, meta)
    steps = _steps(tok, 3)
    for ids in steps[:-1]:
        builder = fr.StepBuilder()
        builder.add(7, ids)
        core.step(builder)
    want = _in_process(tok, "completion", steps, [None] * len(steps), ["stop here"], False, False)
    assert _read_all(client) == want
    assert core.replies(2) == [(fr.STOPPED, 7, 0), (fr.DONE, 1, 0)]
    core.control.close()
    thread.join(10)


def test_a_client_gone_or_a_close_ends_the_stream(tok):
    core, thread = _threaded_writer(tok)
    meta = StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [8])
    client = core.open(1, meta)
    client.close()
    for _ in range(3):  # the first write may still land in the kernel's buffers
        builder = fr.StepBuilder()
        builder.add(8, tok.backend.encode(" hello").ids)
        core.step(builder)
    assert core.replies(1) == [(fr.DONE, 1, fr.DONE_REASONS.index("client_gone"))]
    other = core.open(2, StreamMeta(META.id, "text_completion", 0, "m", "completion", [9]))
    core.control.send(fr.encode_control(fr.CLOSE, 2))
    assert core.replies(1) == [(fr.DONE, 2, fr.DONE_REASONS.index("closed"))]
    assert _read_all(other) == b""
    core.control.close()
    thread.join(10)


def test_a_stalled_client_is_cut_at_the_stall_timeout(tok):
    core, thread = _threaded_writer(tok, stall=0.3)
    meta = StreamMeta(META.id, "text_completion", 0, "m", "completion", [5])
    client = core.open(1, meta)  # never read
    ids = tok.backend.encode(TEXT * 20).ids
    for _ in range(200):  # more than the socket pair's buffers hold
        builder = fr.StepBuilder()
        builder.add(5, ids)
        core.step(builder)
    assert core.replies(1) == [(fr.DONE, 1, fr.DONE_REASONS.index("stalled"))]
    client.close()
    core.control.close()
    thread.join(10)


def test_the_worker_process(tok):
    """The module run as a process, on an inherited control socket, exits when the core's end
    closes."""
    core_end, writer_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    cmd = [sys.executable, "-m", "controller.api.writers.worker", "--fd", str(writer_end.fileno())]
    proc = subprocess.Popen([*cmd, "--model-dir", str(MODEL_DIR)], pass_fds=[writer_end.fileno()])
    writer_end.close()
    try:
        core = _Core(core_end)
        meta = StreamMeta(META.id, "text_completion", META.created, META.model, "completion", [1])
        client = core.open(1, meta)
        steps = _steps(tok, 4)
        reasons = [None] * (len(steps) - 1) + ["length"]
        for ids, reason in zip(steps, reasons):
            builder = fr.StepBuilder()
            builder.add(1, ids, reason)
            core.step(builder)
        want = _in_process(tok, "completion", steps, reasons, [], False, False)
        assert _read_all(client) == want
        assert core.replies(1) == [(fr.DONE, 1, 0)]
        core_end.close()
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
