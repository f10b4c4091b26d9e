"""Running a response's sequences and writing them to the client, streamed (SSE) or whole.

The client's reading speed is bounded like everything else it controls: every write to its
socket must complete within --stream-stall-timeout. uvicorn's send waits while the socket's
buffers are full, so a client that stops reading (or a half-open connection) makes a write
wait; past the timeout the response is aborted, which aborts its sequences in the engine and
frees their KV blocks. Until then the output waiting for the writer is merged per sequence
(deltas.py), so a stalled response holds only what it generated.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response

from controller.api.admission import ABORT, Ticket
from controller.api.choice import Choice
from controller.api.deltas import DeltaQueue
from controller.api.direct_write import direct_write_of
from controller.api.errors import APIError, error_body
from controller.api.sse import sse_line
from controller.api.stall import ClientStalled, StallBoundedStream, close_guard, guarded
from controller.api.writers.handoff import plain_socket, stream_meta, writer_events
from controller.api.writers.pool import WriterPool
from controller.core.outputs import GenerationRequest, OutputDelta
from controller.fleet.engine import Engine, NoExecutorError

log = logging.getLogger(__name__)


async def run_sequences(
    engine: Engine, gens: list[GenerationRequest], ticket: Ticket, queue: DeltaQueue
) -> AsyncIterator[tuple[int, OutputDelta]]:
    """Run all sequences concurrently; yield (index, delta) as they come; abort on exit.

    The engine's step loops put the deltas straight on `queue` (`Engine.submit`): no task per
    sequence. When the ticket is aborted (shutdown), every unfinished sequence ends with
    "abort".
    """
    handles: list = []
    finished = [False] * len(gens)
    try:
        for i, gen in enumerate(gens):
            handles.append(engine.submit(gen, queue.sink(i)))
        remaining = len(gens)
        while remaining:
            i, item = await queue.get()
            if item is ABORT:
                for j, gen in enumerate(gens):
                    if not finished[j]:
                        yield j, OutputDelta(gen.request_id, finished=True, finish_reason="abort")
                return
            ticket.started(i)
            if isinstance(item, Exception):
                finished[i] = True  # it ended there (the engine forgot it)
                if isinstance(item, NoExecutorError):
                    raise APIError(str(item), 503, code="no_healthy_executor")
                raise item
            if item.finished:
                remaining -= 1
                finished[i] = True
            yield i, item
    finally:
        for handle, done in zip(handles, finished):
            if not done:
                engine.abort(handle)


async def collect(
    engine: Engine,
    gens: list[GenerationRequest],
    http: HTTPRequest,
    ticket: Ticket,
    queue: DeltaQueue,
    n: int,
) -> list[Choice] | None:
    """Run to completion (non-streamed; `n` choices per prompt); abort everything and return
    None if the client leaves."""
    choices = [Choice(index=i, prompt_index=i // n) for i in range(len(gens))]

    async def run() -> list[Choice]:
        async with contextlib.aclosing(run_sequences(engine, gens, ticket, queue)) as deltas:
            async for i, d in deltas:
                choices[i].add(d)
        return choices

    task = asyncio.create_task(run())
    gone = asyncio.create_task(client_gone(http))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        ticket.close()


def sse_events(
    engine: Engine,
    gens: list[GenerationRequest],
    chunk: Callable,
    fmt,
    include_usage: bool,
    ticket: Ticket,
    queue: DeltaQueue,
    writers: WriterPool | None = None,
) -> AsyncIterator[bytes]:
    """The server-sent events of a streamed response, ``data: [DONE]`` last (by a stream
    writer process, when `writers` has some and the response and connection let one)."""
    choices = [Choice(index=i, prompt_index=i // max(1, fmt.n)) for i in range(len(gens))]

    def direct(i: int, d: OutputDelta) -> bool:
        """Write a plain, unfinished delta straight to the client from the step loop (the
        writer is idle: everything before it is out); False: it takes the ordinary path."""
        conn = queue.connection
        if conn is None or d.finished or d.error:
            return False
        try:
            if not conn.writable():
                return False
            c = choices[i]
            line = fmt.stream_bytes(c, d, not c.started, include_usage)
            if line is None:
                return False
            ticket.started(i)
            c.add(d)
            if line:
                conn.write(line)
            return True
        except Exception:  # the ordinary path will say what is wrong, on the response's task
            log.exception("a direct write failed")
            queue.connection = None
            return False

    async def events() -> AsyncIterator[bytes]:
        handed = handed_off(writers, engine, gens, fmt, include_usage, ticket, queue)
        if handed is not None:
            async for part in handed:
                yield part
            return
        try:
            async with contextlib.aclosing(run_sequences(engine, gens, ticket, queue)) as deltas:
                for prelude in fmt.stream_prelude(len(gens), include_usage):
                    yield sse_line(prelude)
                queue.direct = direct
                async for i, d in deltas:
                    # Not `empty`: a delta of prompt logprobs alone (a chunked prefill) adds
                    # no output, and the echo's prompt must come once.
                    first = not choices[i].started
                    choices[i].add(d)
                    if d.error:
                        yield sse_line({"error": error_body(APIError(d.error, 500))})
                        continue
                    line = fmt.stream_bytes(choices[i], d, first, include_usage)
                    if line is not None:  # a plain delta, from the template
                        if line:
                            yield line
                        continue
                    body = chunk(choices[i], d, first, include_usage)
                    # One body, none, or several (a chat delta that completes tool calls).
                    for part in [body] if isinstance(body, dict) else body or []:
                        yield sse_line(part)
                if include_usage:
                    yield sse_line(fmt.usage_chunk(choices))
        except APIError as err:
            yield sse_line({"error": error_body(err)})
        finally:
            queue.direct = None
        yield b"data: [DONE]\n\n"

    return events()


def handed_off(
    writers: WriterPool | None,
    engine: Engine,
    gens: list[GenerationRequest],
    fmt,
    include_usage: bool,
    ticket: Ticket,
    queue: DeltaQueue,
) -> AsyncIterator[bytes] | None:
    """The body of a response a stream writer writes; None when it stays here (no writers,
    TLS, logprobs, tools, echo: docs/design/stream_writers.md)."""
    if writers is None:
        return None
    conn = queue.connection
    fd = plain_socket(conn)
    if fd is None or conn is None:
        return None
    events = fmt.stream_prelude(len(gens), include_usage)
    prelude = [sse_line(p).decode("utf-8") for p in events]
    meta = stream_meta(fmt, gens, [writers.new_slot() for _ in gens], prelude, include_usage)
    if meta is None:
        return None
    if not writers.started:
        writers.start()
    return writer_events(writers, engine, gens, meta, fd, conn, ticket, queue)


class TicketedStream(StallBoundedStream):
    """A streamed response that releases its admission ticket however it ends (even when the
    client leaves before the body starts), and aborts when its client stalls."""

    def __init__(
        self, ticket: Ticket, stall_timeout: float, queue: DeltaQueue | None, *args, **kwargs
    ):
        super().__init__(*args, **kwargs)
        self.ticket = ticket  # released when the response is over
        self.stall_timeout = stall_timeout  # seconds one write may wait for the client
        self.queue = queue  # its sequences' channel: told the connection for direct writes

    async def __call__(self, scope, receive, send) -> None:
        if self.queue is not None:
            self.queue.connection = direct_write_of(scope)
        # Closing the body ends the sequences now: their KV blocks go back.
        await super().__call__(scope, receive, send)

    async def finished(self) -> None:
        self.ticket.close()


class GuardedJSONResponse(JSONResponse):
    """A whole response whose writes are bounded by the stall timeout like a stream's."""

    def __init__(self, content, stall_timeout: float, **kwargs):
        super().__init__(content, **kwargs)
        self.stall_timeout = stall_timeout  # seconds one write may wait for the client

    async def __call__(self, scope, receive, send) -> None:
        guard = guarded(send, self.stall_timeout)
        try:
            await super().__call__(scope, receive, guard)
        except ClientStalled as stalled:
            log.warning("%s: the response is dropped", stalled)
        finally:
            close_guard(guard)


def client_closed() -> Response:
    """What a handler returns once its client has left: nothing reaches the closed socket, and
    the access log shows 499 (the status proxies use for "client closed request")."""
    return Response(status_code=499)


async def client_gone(http: HTTPRequest) -> None:
    """Return when the client disconnects. The body has been read, so the server's next ASGI
    message is the disconnect: waiting for it costs nothing, where polling
    ``is_disconnected`` cost every waiting request a wake-up twice a second."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
