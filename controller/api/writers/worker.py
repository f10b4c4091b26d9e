"""A stream writer process: ``python -m controller.api.writers.worker --fd N --model-dir DIR``.

It reads the core's messages (frame.py) from its end of a SOCK_SEQPACKET socket pair (fd N),
keeps the streams the core opened on it (stream.py), and writes their chunks to their clients'
sockets. One thread and a selector: the control socket is read whenever it has messages, a
client socket is watched for writability only while its stream has bytes it did not take, and
for readability until its client sends anything (a hangup, even a half-close, ends the stream
at once: DONE "client_gone"; a pipelined request is the core's to read, after the stream). A
stream whose client takes nothing for --stall-timeout seconds is closed (DONE "stalled"), as
the in-process path's stall guard would; a write error means the client is gone. When the
core's end closes (the controller exited), every stream is closed and the process exits.
"""

from __future__ import annotations

import argparse
import logging
import os
import selectors
import socket
import time
from array import array

from controller.api.formats import TokenText
from controller.api.writers import frame as fr
from controller.api.writers.meta import StreamMeta
from controller.api.writers.stream import WriterStream
from controller.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_MESSAGE = 1 << 20  # the largest message read (a STEP of ~250k token ids)
_FD_SIZE = array("i").itemsize


def receive(
    sock: socket.socket, buffer: memoryview, flags: int = 0
) -> tuple[memoryview, list[int]]:
    """One message (a view of `buffer`, which the next call reuses: read it before then) and
    the fds it carries. Into the caller's buffer: `recvmsg` would allocate its whole size per
    message (and `socket.recv_fds` of Python 3.11 drops `flags`)."""
    n, ancdata, msg_flags, _ = sock.recvmsg_into([buffer], socket.CMSG_SPACE(_FD_SIZE), flags)
    fds = array("i")
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % _FD_SIZE])
    if msg_flags & socket.MSG_TRUNC:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"a message over {len(buffer)} bytes was cut")
    return buffer[:n], list(fds)


class Writer:
    """The writer's streams and its loop."""

    def __init__(self, control: socket.socket, tokenizer: Tokenizer, stall_timeout: float):
        self.control = control  # the core's channel (SOCK_SEQPACKET, blocking for DONE)
        self.tokenizer = tokenizer  # the model's, for every stream's detokenizer
        self.stall_timeout = stall_timeout  # seconds a client may take nothing; 0: no bound
        self.streams: dict[int, WriterStream] = {}  # stream slot -> stream
        self.by_seq: dict[int, WriterStream] = {}  # sequence slot -> its stream
        self.selector = selectors.DefaultSelector()
        self.selector.register(control, selectors.EVENT_READ, None)
        self.running = True  # False once the core's end closed
        self.buffer = memoryview(bytearray(MAX_MESSAGE))  # every message is read into it
        self.token_text = TokenText(tokenizer)  # single tokens' text, for every stream's logprobs

    def run(self) -> None:
        """Serve until the core goes away."""
        while self.running:
            for key, events in self.selector.select(self._timeout()):
                stream = key.data
                if stream is None:
                    self._read_control()
                    continue
                if events & selectors.EVENT_READ:
                    self._check_hangup(stream)
                if events & selectors.EVENT_WRITE and stream.slot in self.streams:
                    self._flush(stream)
            self._check_stalls()
        for stream in list(self.streams.values()):
            self._end(stream, "closed")

    def _timeout(self) -> float | None:
        waiting = [s.since for s in self.streams.values() if s.out]
        if not waiting or not self.stall_timeout:
            return None
        return max(0.0, min(waiting) + self.stall_timeout - time.monotonic())

    def _read_control(self) -> None:
        """Every message the core has queued, without waiting for more."""
        while True:
            try:
                data, fds = receive(self.control, self.buffer, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            except ValueError:
                log.exception("a message from the core was lost")
                continue
            except OSError:  # reset: the core exited with our replies unread
                data = b""
            if not data:
                self.running = False
                return
            self._handle(data, fds)

    def _handle(self, data: memoryview, fds: list[int]) -> None:
        kind = data[0]
        if kind == fr.STEP:
            self._step(fr.decode_step(data))
        elif kind == fr.OPEN:
            slot, meta = fr.decode_open(data)
            self._open(slot, StreamMeta.from_json(meta), fds)
        elif kind == fr.ERROR:
            _, seq, _ = fr.decode_head(data)
            stream = self.by_seq.get(seq)
            if stream is not None:
                stream.fail(seq, bytes(data[fr.HEAD_SIZE :]))
                self._flush(stream)
        elif kind == fr.USAGE:
            _, seq, cached = fr.decode_head(data)
            stream = self.by_seq.get(seq)
            if stream is not None:
                stream.cached[seq] = cached
        elif kind == fr.CLOSE:
            _, slot, how = fr.decode_head(data)
            stream = self.streams.get(slot)
            if stream is not None and how == fr.END_ABORTED:
                stream.abort_open()
                self._flush(stream)
            elif stream is not None:
                self._end(stream, "closed")
        else:
            log.error("a message of unknown kind %d from the core", kind)

    def _open(self, slot: int, meta: StreamMeta, fds: list[int]) -> None:
        if len(fds) != 1:
            for fd in fds:
                socket.close(fd)
            self.control.send(fr.encode_control(fr.DONE, slot, fr.DONE_REASONS.index("error")))
            return
        sock = socket.socket(fileno=fds[0])
        sock.setblocking(False)
        stream = WriterStream(slot, meta, sock, self.tokenizer, self.token_text)
        self.streams[slot] = stream
        for seq in meta.sequences:
            self.by_seq[seq] = stream
        self._watch(stream)  # its reading side: a client that closes is noticed at once

    def _step(self, step: fr.StepFrame) -> None:
        """One step's tokens: each stream's chunks queued, then each touched stream flushed."""
        touched: dict[int, WriterStream] = {}
        ids, at, lps = step.token_ids, 0, None
        entry_at = top_at = 0  # where the next sequence's logprobs start
        for i, (seq, count, code) in enumerate(zip(step.slots, step.counts, step.finish)):
            stream = self.by_seq.get(seq)
            new = ids[at : at + count].tolist() if count else []
            at += count
            if step.logprobs is not None:
                lps, entry_at, top_at = step.logprobs.of(i, entry_at, top_at)
            if stream is not None:
                stream.add(seq, new, fr.FINISH_REASONS[code], lps)
                touched[stream.slot] = stream
                if stream.stopped:  # a stop string ended it: the core finishes it now
                    for stopped in stream.stopped:
                        self.control.send(fr.encode_control(fr.STOPPED, stopped))
                    stream.stopped.clear()
        for stream in touched.values():
            self._flush(stream)

    def _flush(self, stream: WriterStream) -> None:
        try:
            drained = stream.flush()
        except OSError:
            self._end(stream, "client_gone")
            return
        if drained and stream.done:
            self._end(stream, "finished")
        else:
            self._watch(stream)

    def _watch(self, stream: WriterStream) -> None:
        """Watch the client's socket for what matters now: its reading side until the client
        sent anything (a hangup shows there), its writing side while bytes wait."""
        events = selectors.EVENT_READ if stream.reading else 0
        if stream.out:
            events |= selectors.EVENT_WRITE
        if events == stream.events:
            return
        if not stream.events:
            self.selector.register(stream.sock, events, stream)
        elif not events:
            self.selector.unregister(stream.sock)
        else:
            self.selector.modify(stream.sock, events, stream)
        stream.events = events

    def _check_hangup(self, stream: WriterStream) -> None:
        """The client's socket is readable: at its end (the client closed it, or only its
        sending side) or reset, the client is gone; bytes (a pipelined request, which the
        core reads once the stream is over) are left where they are, and no longer watched."""
        try:
            data = stream.sock.recv(1, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._end(stream, "client_gone")
            return
        stream.reading = False
        self._watch(stream)

    def _check_stalls(self) -> None:
        if not self.stall_timeout:
            return
        now = time.monotonic()
        for stream in [s for s in self.streams.values() if s.out]:
            if now - stream.since >= self.stall_timeout:
                self._end(stream, "stalled")

    def _end(self, stream: WriterStream, reason: str) -> None:
        """Forget a stream, close its fd and tell the core why it ended."""
        if stream.events:
            self.selector.unregister(stream.sock)
            stream.events = 0
        self.streams.pop(stream.slot, None)
        for seq in stream.meta.sequences:
            self.by_seq.pop(seq, None)
        stream.close()
        done = fr.encode_control(fr.DONE, stream.slot, fr.DONE_REASONS.index(reason))
        try:
            self.control.send(done)
        except OSError:
            self.running = False


def main(argv: list[str] | None = None) -> None:
    """Run a writer on an inherited control socket."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fd", type=int, required=True, help="the control socket's fd")
    parser.add_argument("--model-dir", required=True, help="the model's tokenizer directory")
    parser.add_argument("--stall-timeout", type=float, default=0.0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    control = socket.socket(fileno=args.fd)
    control.setblocking(True)
    tokenizer = Tokenizer.from_model_dir(args.model_dir)
    Writer(control, tokenizer, args.stall_timeout).run()


if __name__ == "__main__":
    main()
