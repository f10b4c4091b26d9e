"""Pre-serialised SSE chunks for the plain streamed delta: text (and token ids), no logprobs.

Most streamed chunks differ only in their choice's index, text and finish reason; building a
dict and running `json.dumps` over it for each one cost the controller more per token than the
step that made the token. A `ChunkTemplate` serialises a response's constant fields once and
fills the rest in, byte for byte what ``sse_line(body)`` writes for the same body (json's
default separators, ``ensure_ascii=False``, invalid UTF-8 replaced).

An event is one line. JSON escapes the ASCII line breaks but leaves U+0085, U+2028 and U+2029
raw, and clients that split a stream with `str.splitlines` (httpx's `aiter_lines`, among
others) break a line there: an event whose text holds one would reach them as two pieces, the
second (with its finish reason) dropped. Those three are written as \\u escapes: the same JSON
string, one line for every reader.
"""

from __future__ import annotations

import json
from json.encoder import encode_basestring  # the str encoder json.dumps uses (ensure_ascii off)

# The line breaks of `str.splitlines` that JSON leaves raw, as JSON escapes.
_RAW_BREAKS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def one_line(encoded: str) -> str:
    """JSON text with the line breaks JSON leaves raw escaped (ASCII text is returned as is)."""
    return encoded if encoded.isascii() else encoded.translate(_RAW_BREAKS)


def json_string(text: str) -> str:
    """A JSON string literal of `text` that is one line for every reader."""
    return one_line(encode_basestring(text))


class ChunkTemplate:
    """The bytes of one response's plain streamed chunks (`object` names the chunk kind)."""

    def __init__(self, response_id: str, obj: str, created: int, model: str):
        head = one_line(
            json.dumps(
                {"id": response_id, "object": obj, "created": created, "model": model},
                ensure_ascii=False,
            )
        )
        # 'data: {"id": ..., "model": ..., "choices": [{"index": ' then the choice's fields.
        self.head = f'data: {head[:-1]}, "choices": [{{"index": '  # before the index
        self.tails = ("}]}\n\n", '}], "usage": null}\n\n')  # without / with usage

    def completion(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        token_ids: list[int] | None,
        include_usage: bool,
    ) -> bytes:
        """A /v1/completions chunk: {"index", "text", "logprobs": null, "finish_reason"[,
        "token_ids"]}."""
        body = f'{index}, "text": {json_string(text)}, "logprobs": null'
        return self._chunk(body, finish_reason, token_ids, include_usage)

    def chat(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        token_ids: list[int] | None,
        include_usage: bool,
    ) -> bytes:
        """A chat chunk: {"index", "delta": {"content"} or {}, "logprobs": null,
        "finish_reason"[, "token_ids"]}."""
        delta = f'{{"content": {json_string(text)}}}' if text else "{}"
        body = f'{index}, "delta": {delta}, "logprobs": null'
        return self._chunk(body, finish_reason, token_ids, include_usage)

    def _chunk(
        self,
        body: str,
        finish_reason: str | None,
        token_ids: list[int] | None,
        include_usage: bool,
    ) -> bytes:
        reason = "null" if finish_reason is None else json_string(finish_reason)
        ids = "" if token_ids is None else f', "token_ids": {json.dumps(token_ids)}'
        tail = self.tails[include_usage]
        line = f'{self.head}{body}, "finish_reason": {reason}{ids}{tail}'
        return line.encode("utf-8", "replace")


def framed(body: bytes) -> bytes:
    """One HTTP/1.1 chunk of a chunked body, framed as uvicorn frames a ``more_body``
    message's: what the direct write and the stream writers put on the socket."""
    return b"%x\r\n%b\r\n" % (len(body), body)


def sse_line(body: dict) -> bytes:
    """One SSE event, on one line. Bytes, encoded here: nothing unencodable can fail the
    stream."""
    line = f"data: {one_line(json.dumps(body, ensure_ascii=False))}\n\n"
    return line.encode("utf-8", "replace")
