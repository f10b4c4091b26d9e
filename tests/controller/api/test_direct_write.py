"""Direct writes of streamed chunks from the step loop: the bytes the client gets are those of
the ordinary path, in order, whichever way each chunk went; only plain, unfinished deltas go
directly, only while the writer is idle and the connection writable."""

from __future__ import annotations

import asyncio

from controller.api.deltas import DeltaQueue
from controller.api.formats import ChatFormatter, CompletionFormatter, Prompt, ResponseMeta
from controller.api.streaming import sse_events
from controller.core.outputs import GenerationRequest, OutputDelta

META = ResponseMeta(id="cmpl-1", created=1_700_000_000, model="m")
TEXTS = ["He", "llo", ", ", "wor", "ld", " é", "🙂", ""]


class _Tok:
    def decode(self, ids, skip_special_tokens=False) -> str:
        return "x"


class _Engine:
    """Keeps each sequence's sink; the test plays the step loop."""

    def __init__(self):
        self.sinks: list = []
        self.aborted: list = []

    def submit(self, gen, sink):
        self.sinks.append(sink)
        return gen.request_id

    def abort(self, handle):
        self.aborted.append(handle)


class _Ticket:
    def started(self, index: int) -> None:
        pass


class _Connection:
    """A DirectWrite over a list shared with the ordinary path's output."""

    def __init__(self, out: list, writable):
        self.out, self.is_writable, self.writes = out, writable, 0

    def writable(self) -> bool:
        return self.is_writable(self.writes)

    def write(self, body: bytes) -> None:
        self.writes += 1
        self.out.append(body)


def _gen(i: int) -> GenerationRequest:
    return GenerationRequest(f"r-{i}", [1, 2], None, 100)


async def _stream(fmt, n: int, direct_when) -> tuple[bytes, int]:
    """The response's bytes (direct and ordinary, in the order written) and the direct count."""
    engine, queue, out = _Engine(), DeltaQueue(), []
    conn = _Connection(out, direct_when) if direct_when is not None else None
    queue.connection = conn
    gens = [_gen(i) for i in range(n)]
    events = sse_events(engine, gens, fmt.stream_chunk, fmt, True, _Ticket(), queue)

    async def write() -> None:
        async for chunk in events:
            out.append(chunk)

    writer = asyncio.create_task(write())
    while len(engine.sinks) < n:
        await asyncio.sleep(0)
    for step, text in enumerate(TEXTS):
        last = step == len(TEXTS) - 1
        for i, sink in enumerate(engine.sinks):  # one step: every sequence's delta
            sink.put_nowait(
                OutputDelta(
                    f"r-{i}",
                    text=text,
                    token_ids=[10 + step],
                    finished=last,
                    finish_reason="length" if last else None,
                    num_output_tokens=step + 1,
                )
            )
        for _ in range(5):  # the writer runs between steps (or not: merged then)
            await asyncio.sleep(0)
    await writer
    return b"".join(out), conn.writes if conn is not None else 0


def test_direct_and_ordinary_writes_give_the_same_bytes():
    async def main():
        prompt = Prompt([1, 2], None)
        for fmt_of in (
            lambda: CompletionFormatter(_Tok(), META, [prompt], 1, False, None),
            lambda: ChatFormatter(_Tok(), META, prompt, False),
        ):
            ordinary, none = await _stream(fmt_of(), 1, None)
            direct, writes = await _stream(fmt_of(), 1, lambda k: True)
            assert none == 0 and writes == len(TEXTS) - 1  # every unfinished delta
            assert direct == ordinary
            # A connection that pauses now and then: those chunks take the ordinary path.
            mixed, some = await _stream(fmt_of(), 1, lambda k: k % 2 == 0)
            assert 0 < some < writes and mixed == ordinary
            assert ordinary.endswith(b"data: [DONE]\n\n") and b'"usage": {' in ordinary

    asyncio.run(main())


def test_several_sequences_go_directly_while_the_writer_is_idle():
    async def main():
        fmt = CompletionFormatter(_Tok(), META, [Prompt([1, 2], None)], 3, False, None)
        ordinary, _ = await _stream(fmt, 3, None)
        fmt = CompletionFormatter(_Tok(), META, [Prompt([1, 2], None)], 3, False, None)
        direct, writes = await _stream(fmt, 3, lambda k: True)
        assert writes > 0 and direct == ordinary

    asyncio.run(main())


def test_the_queue_tries_direct_only_while_its_writer_waits_and_nothing_is_pending():
    async def main():
        q, tried = DeltaQueue(), []
        q.direct = lambda i, d: tried.append(i) or True
        q.put_nowait((0, OutputDelta("a", text="x")))  # no writer waiting: queued
        assert tried == [] and q.pending == 1
        assert (await q.get())[1].text == "x"
        getter = asyncio.create_task(q.get())
        await asyncio.sleep(0)  # the writer waits now
        q.put_nowait((0, OutputDelta("a", text="y")))
        assert tried == [0] and q.pending == 0 and not getter.done()
        q.direct = lambda i, d: False  # declined: queued, and the writer wakes
        q.put_nowait((1, OutputDelta("b", text="z")))
        assert (await getter)[1].text == "z"

    asyncio.run(main())
