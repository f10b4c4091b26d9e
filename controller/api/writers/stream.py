"""One streamed response as its writer process holds it: the client's socket, a detokenizer
per sequence, the chunk template and the bytes not yet written."""

from __future__ import annotations

import json
import socket
import time

from controller.api.sse import ChunkTemplate, framed
from controller.api.writers.meta import StreamMeta
from controller.text.detokenizer import OutputTextState
from controller.text.tokenizer import Tokenizer

DONE_EVENT = b"data: [DONE]\n\n"


class WriterStream:
    """A response's sequences (by slot) and its connection, until its last chunk is written."""

    def __init__(self, slot: int, meta: StreamMeta, sock: socket.socket, tokenizer: Tokenizer):
        self.slot = slot  # the stream's slot (its OPEN's)
        self.meta = meta  # how its chunks look
        self.sock = sock  # the client's connection (a dup of the core's fd), non-blocking
        self.template = ChunkTemplate(meta.response_id, meta.obj, meta.created, meta.model)
        self.texts = {
            seq: OutputTextState(
                tokenizer,
                stop=meta.stop,
                include_stop_str_in_output=meta.include_stop_str_in_output,
                skip_special_tokens=meta.skip_special_tokens,
            )
            for seq in meta.sequences
        }  # sequence slot -> its detokenizer and stop strings
        self.index = {seq: i for i, seq in enumerate(meta.sequences)}  # slot -> choice index
        self.open = set(meta.sequences)  # sequences not finished yet
        self.generated = dict.fromkeys(meta.sequences, 0)  # tokens each one streamed
        self.cached = dict.fromkeys(meta.sequences, 0)  # its prompt tokens from the cache
        self.stopped: list[int] = []  # sequences a stop string ended (the core must know)
        self.out = bytearray()  # framed bytes not written yet
        self.since = 0.0  # monotonic time `out` last became non-empty or drained some
        self.ended = False  # [DONE] is in `out`: the stream ends once `out` drains
        for event in meta.prelude:
            self.queue(framed(event.encode("utf-8")))

    def add(self, seq: int, token_ids: list[int], reason: str | None) -> None:
        """A sequence's new token ids (and its end): its chunk, framed, onto `out`."""
        if seq not in self.open:
            return  # ended already (a stop string): what the core sent since is moot
        state = self.texts[seq]
        text, stopped = state.update(token_ids, reason is not None)
        if stopped and reason is None:
            reason = "stop"
            self.stopped.append(seq)
        if reason is not None:
            self.open.discard(seq)
        self.generated[seq] += len(token_ids)
        body = self.chunk(seq, text, token_ids, reason)
        if body:
            self.queue(framed(body))
        self._end_if_last()

    def fail(self, seq: int, event: bytes) -> None:
        """A sequence failed: its error event instead of a last chunk (as sse_events writes
        an error delta), then the end if it was the last."""
        if seq not in self.open:
            return
        self.open.discard(seq)
        self.queue(framed(event))
        self._end_if_last()

    def _end_if_last(self) -> None:
        if not self.open and not self.ended:
            self.ended = True
            if self.meta.include_usage:
                self.queue(framed(self.usage_event()))
            self.queue(framed(DONE_EVENT))

    def abort_open(self) -> None:
        """End every unfinished sequence with "abort" (an empty chunk each, as the in-process
        path writes for a response aborted at shutdown: held-back text is not flushed), then
        the usage chunk and [DONE]."""
        for seq in self.meta.sequences:
            if seq in self.open:
                self.open.discard(seq)
                self.queue(framed(self.chunk(seq, "", [], "abort")))
        self._end_if_last()

    def usage_event(self) -> bytes:
        """The usage chunk, as the formatters' `usage_chunk` and `sse_line` write it."""
        meta = self.meta
        completion = sum(self.generated.values())
        body = {
            "id": meta.response_id,
            "object": meta.obj,
            "created": meta.created,
            "model": meta.model,
            "choices": [],
            "usage": {
                "prompt_tokens": meta.prompt_tokens,
                "completion_tokens": completion,
                "total_tokens": meta.prompt_tokens + completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())},
            },
        }
        line = f"data: {json.dumps(body, ensure_ascii=False)}\n\n"
        return line.encode("utf-8", "replace")

    def chunk(self, seq: int, text: str, token_ids: list[int], reason: str | None) -> bytes:
        """The SSE event of one sequence's step, as the in-process path's `stream_bytes`
        builds it (b"" when it says nothing)."""
        meta = self.meta
        ids = token_ids if meta.return_token_ids else None
        index = self.index[seq]
        if meta.kind == "chat":
            if not text and reason is None and not token_ids:
                return b""
            return self.template.chat(index, text, reason, ids, meta.include_usage)
        if not text and reason is None:
            return b""
        return self.template.completion(index, text, reason, ids, meta.include_usage)

    def queue(self, data: bytes) -> None:
        if not self.out:
            self.since = time.monotonic()
        self.out += data

    def flush(self) -> bool:
        """Write what the socket takes now; True when nothing is left. OSError: the client is
        gone."""
        while self.out:
            try:
                sent = self.sock.send(self.out)
            except BlockingIOError:
                return False
            del self.out[:sent]
            self.since = time.monotonic()
        return True

    @property
    def done(self) -> bool:
        """Every sequence ended and every byte, [DONE] included, is written."""
        return self.ended and not self.out

    def close(self) -> None:
        """Close the writer's dup of the connection (the core's fd stays open)."""
        self.sock.close()
