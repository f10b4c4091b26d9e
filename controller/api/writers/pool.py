"""The scheduling core's side of the stream writers: their processes, their channels, and the
sinks through which the step loops hand them each sequence's new tokens.

The core never blocks on a writer: a message the channel's socket does not take now waits in
a bounded list, flushed when the socket is writable again; a writer that falls further behind
is treated as one stalled client for all its streams (they end "stalled"). A writer that dies
ends its streams the same way ("error": their requests are aborted, their connections closed)
and is started again.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import subprocess
import sys
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from common.wire.step_types import TokenLogprobs
from controller.api.errors import APIError, error_body
from controller.api.sse import sse_line
from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.api.writers.worker import MAX_MESSAGE, receive
from controller.fleet.engine import NoExecutorError

log = logging.getLogger(__name__)

MAX_PENDING = 256  # messages a channel holds for a writer that does not read; then it is behind
RESTART_DELAY = 1.0  # seconds before a writer that exited is started again
SNDBUF = 4 << 20  # the control socket's send buffer: a step's frame for every stream fits


@dataclass(eq=False)
class OpenStream:
    """A stream a writer owns, as the core tracks it."""

    slot: int  # the stream's slot on its writer
    sequences: list[int]  # its sequences' slots
    done: asyncio.Future  # set to the DONE reason (frame.DONE_REASONS) when the writer ends it
    stopped: set[int] = field(default_factory=set)  # sequences a writer's stop string ended
    on_stop: Callable[[int], None] | None = None  # told each of those, when it comes


def message_limit(sock: socket.socket) -> int:
    """The largest message to send on a control socket: what the writer reads at once, and
    what the socket's send buffer takes in one datagram (the kernel caps SO_SNDBUF at
    net.core.wmem_max and reports it doubled; half of that leaves room for its overhead)."""
    return min(MAX_MESSAGE, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2)


def error_event(item: Any) -> bytes:
    """The SSE error event of a failed sequence, as streaming.py's `sse_line` writes it."""
    if isinstance(item, NoExecutorError):
        err = APIError(str(item), 503, code="no_healthy_executor")
    else:
        err = APIError(getattr(item, "error", "") or str(item), 500)
    return sse_line({"error": error_body(err)})


class TokenSink:
    """One sequence's sink for the step loops (`takes_tokens`: the fleet hands it token ids,
    not deltas, and builds no text); the writer's channel sends a step's frame once."""

    __slots__ = ("channel", "slot", "started")
    takes_tokens = True  # the fleet's mark of a sink that takes raw token ids

    def __init__(self, channel: WriterChannel, slot: int, started: Callable[[], None] | None):
        self.channel = channel  # the writer that owns the sequence's stream
        self.slot = slot  # the sequence's slot
        self.started = started  # called at its first output (it stops counting as queued)

    def put_tokens(
        self,
        token_ids: list[int],
        finish_reason: str | None,
        num_cached_tokens: int = 0,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """A step's new ids for the sequence (and its end; its prompt's cache hit, for the
        usage chunk, is sent with its first tokens and its end; its tokens' logprobs, when
        it asked for them)."""
        if self.started is not None:
            self.started()
            self.started = None
            self.channel.usage(self.slot, num_cached_tokens)
        elif finish_reason is not None:
            self.channel.usage(self.slot, num_cached_tokens)
        self.channel.add(self.slot, token_ids, finish_reason, logprobs)

    def put_nowait(self, item) -> None:
        """An exception or an error delta: the sequence ends with the error event the
        in-process path writes (status 500, or 503 no_healthy_executor)."""
        if self.started is not None:
            self.started()
            self.started = None
        self.channel.fail(self.slot, error_event(item))


class WriterChannel:
    """One writer process and the core's end of its control socket."""

    def __init__(self, index: int, model_dir: str, stall_timeout: float):
        self.index = index  # its position in the pool (for logs)
        self.model_dir = model_dir  # the tokenizer the writer loads
        self.stall_timeout = stall_timeout  # seconds a client may take nothing
        self.builder = fr.StepBuilder()  # this step's frame, being gathered
        self.flush_due = False  # a flush of `builder` is scheduled on the loop
        self.pending: deque[tuple[bytes, list[int]]] = deque()  # not taken by the socket yet
        self.streams: dict[int, OpenStream] = {}  # stream slot -> stream
        self.owner: dict[int, OpenStream] = {}  # sequence slot -> its stream
        self.sock: socket.socket | None = None
        self.proc: subprocess.Popen | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.buffer = memoryview(bytearray(64))  # replies are read into it (9 bytes each)
        self.limit = MAX_MESSAGE  # the largest STEP sent: larger steps are split (start sets it)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start the writer process and watch its replies."""
        self.loop = loop
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SNDBUF)
        self.limit = message_limit(ours)
        ours.setblocking(False)
        cmd = [sys.executable, "-m", "controller.api.writers.worker", "--fd", str(theirs.fileno())]
        cmd += ["--model-dir", self.model_dir, "--stall-timeout", str(self.stall_timeout)]
        self.proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], cwd=os.getcwd())
        theirs.close()
        self.sock = ours
        loop.add_reader(ours.fileno(), self._on_replies)

    def open(self, slot: int, meta: StreamMeta, fd: int) -> OpenStream:
        """Hand a connection to the writer (its fd is duplicated by the kernel in passing)."""
        assert self.loop is not None
        stream = OpenStream(slot, list(meta.sequences), self.loop.create_future())
        self.streams[slot] = stream
        for seq in meta.sequences:
            self.owner[seq] = stream
        self._send(fr.encode_open(slot, meta.to_json()), [fd])
        return stream

    def close_stream(self, slot: int, end_aborted: bool = False) -> None:
        """Ask the writer to drop a stream now (the DONE "closed" follows), or, `end_aborted`,
        to end it as an aborted response (its last chunks and [DONE]; DONE "finished")."""
        if slot in self.streams:
            how = fr.END_ABORTED if end_aborted else 0
            self._send(fr.encode_control(fr.CLOSE, slot, how))

    def fail(self, seq: int, event: bytes) -> None:
        """A sequence failed: its error event, after what this step gathered so far."""
        self.flush()
        self._send(fr.encode_error(seq, event))

    def usage(self, seq: int, num_cached_tokens: int) -> None:
        """A sequence's cached prompt tokens (sent before this step's frame)."""
        self._send(fr.encode_control(fr.USAGE, seq, num_cached_tokens))

    def add(
        self,
        seq: int,
        token_ids: list[int],
        finish_reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """A sequence's step, into this step's frame (sent once, after the step's updates)."""
        self.builder.add(seq, token_ids, finish_reason, logprobs)
        if not self.flush_due and self.loop is not None:
            self.flush_due = True
            self.loop.call_soon(self.flush)

    def flush(self) -> None:
        """Send the step's frame (several, when it is larger than a writer reads at once)."""
        self.flush_due = False
        if len(self.builder):
            for message in self.builder.take_all(self.limit):
                self._send(message)

    def _send(self, message: bytes, fds: list[int] | None = None) -> None:
        if self.pending or not self._try_send(message, fds or []):
            if len(self.pending) >= MAX_PENDING:
                log.warning("stream writer %d is behind: its streams end", self.index)
                self._end_all("stalled")
                return
            if not self.pending and self.loop is not None and self.sock is not None:
                self.loop.add_writer(self.sock.fileno(), self._drain)
            if fds:  # the fd may be closed by the time it goes: hold a dup of our own
                fds = [os.dup(fd) for fd in fds]
            self.pending.append((message, fds or []))

    def _try_send(self, message: bytes, fds: list[int]) -> bool:
        if self.sock is None:
            return True  # no writer (it died): what it would get is moot
        try:
            if fds:
                socket.send_fds(self.sock, [message], fds)
            else:
                self.sock.send(message)
            return True
        except BlockingIOError:
            return False
        except OSError:
            self._died()
            return True

    def _drain(self) -> None:
        while self.pending:
            message, fds = self.pending[0]
            if not self._try_send(message, fds):
                return
            self.pending.popleft()
            for fd in fds:
                os.close(fd)
        if self.loop is not None and self.sock is not None:
            self.loop.remove_writer(self.sock.fileno())

    def _on_replies(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data, _ = receive(self.sock, self.buffer, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except ValueError:
                continue  # replies are 9 bytes: never cut
            except OSError:
                data = b""
            if not data:
                self._died()
                return
            kind, slot, extra = fr.decode_head(data)
            if kind == fr.DONE:
                self._done(slot, fr.DONE_REASONS[extra])
            elif kind == fr.STOPPED and (stream := self.owner.get(slot)) is not None:
                stream.stopped.add(slot)
                if stream.on_stop is not None:
                    stream.on_stop(slot)

    def _done(self, slot: int, reason: str) -> None:
        stream = self.streams.pop(slot, None)
        if stream is None:
            return
        for seq in stream.sequences:
            self.owner.pop(seq, None)
        if not stream.done.done():
            stream.done.set_result(reason)

    def _end_all(self, reason: str) -> None:
        for slot in list(self.streams):
            self._done(slot, reason)

    def _died(self) -> None:
        """The writer is gone: its streams end "error", and a new one starts."""
        log.error("stream writer %d exited: its streams end; it is started again", self.index)
        self.stop()
        self._end_all("error")
        if self.loop is not None and not self.loop.is_closed():
            # Not at once: a writer that cannot start would be restarted in a tight loop.
            self.loop.call_later(RESTART_DELAY, self._restart)

    def _restart(self) -> None:
        if self.sock is None and self.loop is not None and not self.loop.is_closed():
            self.start(self.loop)

    def stop(self) -> None:
        """Stop watching the writer and end its process (its streams are not told)."""
        if self.sock is not None:
            if self.loop is not None:
                self.loop.remove_reader(self.sock.fileno())
                self.loop.remove_writer(self.sock.fileno())
            self.sock.close()
            self.sock = None
        for _, fds in self.pending:
            for fd in fds:
                os.close(fd)
        self.pending.clear()
        self.builder = fr.StepBuilder()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class WriterPool:
    """N writer processes; a stream goes to the one with the fewest."""

    def __init__(
        self,
        count: int,
        model_dir: str,
        stall_timeout: float,
        registry: CollectorRegistry | None = None,
    ):
        self.channels = [WriterChannel(i, model_dir, stall_timeout) for i in range(count)]
        self._slots = itertools.count(1)  # stream and sequence slots, never reused
        self.started = False
        # Streams handed to writers, by how they ended (frame.DONE_REASONS).
        self.ended = Counter(
            "tandem:stream_writer_streams",
            "Streamed responses written by stream writer processes, by how they ended: "
            "finished, client_gone, stalled, closed, error (the writer exited or fell behind)",
            ["reason"],
            registry=registry,
        )
        open_now = Gauge(
            "tandem:stream_writer_streams_open",
            "Streamed responses the stream writer processes own now",
            registry=registry,
        )
        open_now.set_function(lambda: sum(len(c.streams) for c in self.channels))

    def start(self) -> None:
        """Start every writer (on the running loop)."""
        loop = asyncio.get_running_loop()
        for channel in self.channels:
            channel.start(loop)
        self.started = True

    def count_end(self, reason: str) -> None:
        """Count a stream's end."""
        self.ended.labels(reason).inc()

    def pick(self) -> WriterChannel:
        """The channel with the fewest streams."""
        return min(self.channels, key=lambda c: len(c.streams))

    def new_slot(self) -> int:
        """A slot no stream or sequence had before."""
        return next(self._slots)

    def stop(self) -> None:
        """End every writer process."""
        for channel in self.channels:
            channel._end_all("closed")
            channel.stop()
        self.started = False
