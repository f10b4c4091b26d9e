"""Handing a streamed response's output to a stream writer once its headers are out.

The response's head (and a chat's role chunk, which the writer writes first) is the
controller's; from then on the writer owns the connection's bytes: the step loops hand the
sequences' token ids to its channel, and the connection's reading is paused. When the writer
says the stream is over, the response ends here (uvicorn writes the terminating chunk and the
connection is kept alive) or, when it did not finish (client gone, stalled, writer lost), the
connection is closed and the sequences still running are aborted, freeing their blocks.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from controller.api.admission import Ticket
from controller.api.deltas import DeltaQueue
from controller.api.direct_write import DirectWrite
from controller.api.formats import ChatFormatter
from controller.api.writers.meta import StreamMeta
from controller.api.writers.pool import TokenSink, WriterPool
from controller.core.outputs import GenerationRequest
from controller.text.tools import FORMATS

log = logging.getLogger(__name__)


def plain_socket(conn: DirectWrite | None) -> int | None:
    """The fd of a connection a writer can take now: plain TCP (no TLS), its head written and
    nothing left in its buffer (the writer's bytes must come after the controller's)."""
    if conn is None or not conn.writable():
        return None
    transport = conn.cycle.transport
    if transport.get_extra_info("sslcontext") is not None:
        return None
    if transport.get_extra_info("ssl_object") is not None:
        return None
    if transport.get_write_buffer_size():
        return None
    sock = transport.get_extra_info("socket")
    return None if sock is None else sock.fileno()


def stream_meta(
    fmt: Any,
    gens: list[GenerationRequest],
    sequences: list[int],
    prelude: list[str],
    include_usage: bool,
) -> StreamMeta | None:
    """What the writer needs to format this response's chunks; None when the response is not
    one a writer formats yet (prompt logprobs; tools of a format it cannot rebuild by name)."""
    chat = isinstance(fmt, ChatFormatter)
    tools = fmt.tools if chat else None
    if tools is not None and FORMATS.get(tools.fmt.name) is not type(tools.fmt):
        return None  # a format the writer could not rebuild by its name
    if any(g.sampling.prompt_logprobs is not None for g in gens):
        return None
    gen = gens[0]
    meta = fmt.meta
    prompts = [fmt.prompt] if chat else fmt.prompts
    prompt_tokens = sum(len(p.token_ids) for p in prompts)  # as `usage_chunk` counts them
    return StreamMeta(
        response_id=meta.id,
        obj="chat.completion.chunk" if chat else "text_completion",
        created=meta.created,
        model=meta.model,
        kind="chat" if chat else "completion",
        sequences=sequences,
        return_token_ids=fmt.return_token_ids,
        skip_special_tokens=gen.skip_special_tokens,
        stop=list(gen.stop),
        include_stop_str_in_output=gen.include_stop_str_in_output,
        prelude=prelude,
        include_usage=include_usage,
        prompt_tokens=prompt_tokens,
        logprobs=bool(fmt.logprobs) if chat else fmt.logprobs is not None,
        echo=_echo_texts(fmt, len(gens)),
        tool_parser=tools.fmt.name if tools is not None else "",
        tool_max_calls=tools.max_calls if tools is not None else None,
    )


def _echo_texts(fmt: Any, count: int) -> list[str]:
    """Each sequence's prompt text when a completion echoes it (choice i answers prompt
    i // n), else nothing."""
    if isinstance(fmt, ChatFormatter) or not fmt.echo:
        return []
    return [fmt._prompt_text(fmt.prompts[i // max(1, fmt.n)]) for i in range(count)]


async def writer_events(
    pool: WriterPool,
    engine: Any,
    gens: list[GenerationRequest],
    meta: StreamMeta,
    fd: int,
    conn: DirectWrite,
    ticket: Ticket,
    queue: DeltaQueue,
) -> AsyncIterator[bytes]:
    """The response's body while a writer writes it: nothing (the writer writes every chunk,
    [DONE] included); the body ends when the writer is done."""
    channel = pool.pick()
    transport = conn.cycle.transport
    transport.pause_reading()  # the core touches no byte of the connection meanwhile
    stream = channel.open(pool.new_slot(), meta, fd)
    handles = {}
    # A sequence a stop string ended (the writer found it) stops now: its blocks go back.
    stream.on_stop = lambda seq: engine.abort(handles[seq], "stop") if seq in handles else None
    reason = "error"
    try:
        for i, gen in enumerate(gens):
            seq = meta.sequences[i]
            handles[seq] = engine.submit(
                gen, TokenSink(channel, seq, lambda i=i: ticket.started(i))
            )
        reason = await _until_done(channel, stream, queue)
    finally:
        pool.count_end(reason)
        if not stream.done.done():  # cancelled: the writer lets go of the connection too
            channel.close_stream(stream.slot)
        for handle in handles.values():  # nothing for those that ended
            engine.abort(handle)
        if reason == "finished":
            transport.resume_reading()
        else:
            log.info("a writer-streamed response ended %s: its connection is closed", reason)
            transport.abort()
    return
    yield b""  # an async generator that yields nothing


async def _until_done(channel, stream, queue: DeltaQueue) -> str:
    """The writer's DONE reason; a shutdown's abort asks the writer to end the stream with
    "abort" chunks and [DONE], as the in-process path does."""
    aborted = asyncio.ensure_future(queue.wait_aborted())
    try:
        await asyncio.wait({stream.done, aborted}, return_when=asyncio.FIRST_COMPLETED)
        if not stream.done.done():  # shutdown: the response ends as an aborted one
            channel.close_stream(stream.slot, end_aborted=True)
        return await stream.done
    finally:
        aborted.cancel()
