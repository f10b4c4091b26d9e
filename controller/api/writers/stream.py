"""One streamed response as its writer process holds it: the client's socket, a detokenizer
per sequence, the chunk template and the bytes not yet written."""

from __future__ import annotations

import socket
import time

from common.wire.step_types import TokenLogprobs
from controller.api.choice import Choice
from controller.api.formats import (
    ChatFormatter,
    CompletionFormatter,
    Prompt,
    ResponseMeta,
    TokenText,
)
from controller.api.sse import ChunkTemplate, framed, sse_line
from controller.api.tool_output import ToolPolicy
from controller.api.writers.meta import StreamMeta
from controller.core.outputs import OutputDelta
from controller.text.detokenizer import OutputTextState
from controller.text.tokenizer import Tokenizer
from controller.text.tools import FORMATS

DONE_EVENT = b"data: [DONE]\n\n"


class WriterStream:
    """A response's sequences (by slot) and its connection, until its last chunk is written."""

    def __init__(
        self,
        slot: int,
        meta: StreamMeta,
        sock: socket.socket,
        tokenizer: Tokenizer,
        token_text: TokenText | None = None,
    ):
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
        # The response's formatter, for chunks the template does not build (logprobs, echo,
        # tool calls).
        self.fmt = rich_formatter(meta, tokenizer, token_text)
        self.fresh = set(meta.sequences)  # sequences with no chunk yet (echo's goes first)
        self.reading = True  # its client sent nothing since: its reading side is watched
        self.events = 0  # what the writer's selector watches its socket for now
        for event in meta.prelude:
            self.queue(framed(event.encode("utf-8")))

    def add(
        self,
        seq: int,
        token_ids: list[int],
        reason: str | None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """A sequence's new token ids (and its end, its logprobs): its chunk, framed, onto
        `out`."""
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
        self._write_chunk(seq, text, token_ids, reason, logprobs)
        self._end_if_last()

    def _write_chunk(
        self,
        seq: int,
        text: str,
        token_ids: list[int],
        reason: str | None,
        logprobs: list[TokenLogprobs] | None,
    ) -> None:
        if self.fmt is None:
            body = self.chunk(seq, text, token_ids, reason)
            if body:
                self.queue(framed(body))
            return
        for event in self.rich_chunks(seq, text, token_ids, reason, logprobs):
            self.queue(framed(event))

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
                self._write_chunk(seq, "", [], "abort", None)
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
        return sse_line(body)

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

    def rich_chunks(
        self,
        seq: int,
        text: str,
        token_ids: list[int],
        reason: str | None,
        logprobs: list[TokenLogprobs] | None,
    ) -> list[bytes]:
        """The SSE events of one sequence's step by the response's formatter, as sse_events
        writes a delta (`stream_bytes`, else `stream_chunk`)."""
        fmt, index = self.fmt, self.index[seq]
        choice = Choice(index=index, prompt_index=index)  # the formatters read no more of it
        d = OutputDelta("", text, token_ids, logprobs, None, reason is not None, reason)
        first = seq in self.fresh
        self.fresh.discard(seq)
        line = fmt.stream_bytes(choice, d, first, self.meta.include_usage)
        if line is not None:
            return [line] if line else []
        body = fmt.stream_chunk(choice, d, first, self.meta.include_usage)
        return [sse_line(part) for part in ([body] if isinstance(body, dict) else body or [])]

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


def rich_formatter(
    meta: StreamMeta, tokenizer: Tokenizer, token_text: TokenText | None
) -> ChatFormatter | CompletionFormatter | None:
    """The in-process formatter of a response whose chunks the template does not build
    (logprobs, echo, tool calls), set up from its meta; None for plain chunks."""
    if not meta.logprobs and not meta.echo and not meta.tool_parser:
        return None
    head = ResponseMeta(meta.response_id, meta.created, meta.model)
    fmt: ChatFormatter | CompletionFormatter
    if meta.kind == "chat":
        tools = None
        if meta.tool_parser:
            tools = ToolPolicy(FORMATS[meta.tool_parser](), meta.tool_max_calls)
        prompt = Prompt([], None)
        fmt = ChatFormatter(tokenizer, head, prompt, meta.logprobs, meta.return_token_ids, tools)
    else:
        # One prompt per sequence (choice i answers prompt i), its text given for the echo.
        prompts = [Prompt([], text) for text in meta.echo] or [Prompt([], None)]
        lps = 0 if meta.logprobs else None  # the formatter tests `is not None` only
        fmt = CompletionFormatter(
            tokenizer, head, prompts, 1, bool(meta.echo), lps, meta.return_token_ids
        )
    if token_text is not None:
        fmt.token_text = token_text  # the writer's cache, shared by its streams
    return fmt
