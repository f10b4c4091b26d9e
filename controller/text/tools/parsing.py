"""Reading calls out of a model's output, whole or as it streams.

A call block runs from the format's start tag to the first end tag after it. A block whose body
is valid calls becomes calls; any other block (bad JSON, no end tag before the output ended)
stays in the content as written. The content is the text outside call blocks, stripped of
leading and trailing whitespace. Both parsers follow these rules, so a streamed response
assembles to the same message as a whole one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from controller.text.tools.base import ParsedOutput, ToolCall, ToolCallFormat


def parse_output(fmt: ToolCallFormat, text: str, max_calls: int | None = None) -> ParsedOutput:
    """The content and calls of a finished output (`max_calls`: later calls are dropped)."""
    content, calls, pos = [], [], 0
    while True:
        start = text.find(fmt.start_tag, pos)
        end = -1 if start < 0 else text.find(fmt.end_tag, start + len(fmt.start_tag))
        if end < 0:
            content.append(text[pos:])
            break
        content.append(text[pos:start])
        body = text[start + len(fmt.start_tag) : end]
        pos = end + len(fmt.end_tag)
        found = fmt.parse_body(body)
        if found is None:
            content.append(text[start:pos])
        else:
            calls.extend(found)
    calls = calls if max_calls is None else calls[:max_calls]
    text_out = "".join(content).strip()
    return ParsedOutput(None if calls and not text_out else text_out, calls)


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (text that may become it)."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass
class StreamedPart:
    """What one piece of streamed output added."""

    content: str = ""  # new content text
    calls: list[ToolCall] = field(default_factory=list)  # calls completed by this piece


class IncrementalParser:
    """Reads an output piece by piece: content is handed on as soon as it cannot be part of a
    call block (text that may be a start tag is held back), calls when their block closes.
    Whitespace is held until text follows it, so the content is stripped as a whole output's."""

    def __init__(self, fmt: ToolCallFormat, max_calls: int | None = None):
        self.fmt = fmt  # the format read
        self.max_calls = max_calls  # later calls are dropped
        self.num_calls = 0  # calls handed on so far
        self._buf = ""  # text not handed on yet (a possible tag, or an open block's body)
        self._in_block = False  # the buffer is the body of an open block
        self._space = ""  # whitespace held until non-space content follows
        self._started = False  # some non-space content was handed on

    def feed(self, text: str) -> StreamedPart:
        """Take the next piece of output."""
        out = StreamedPart()
        self._buf += text
        while True:
            if not self._in_block:
                start = self._buf.find(self.fmt.start_tag)
                if start < 0:
                    keep = _partial_tag(self._buf, self.fmt.start_tag)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return out
                self._content(out, self._buf[:start])
                self._buf = self._buf[start + len(self.fmt.start_tag) :]
                self._in_block = True
            end = self._buf.find(self.fmt.end_tag)
            if end < 0:
                return out
            body, self._buf = self._buf[:end], self._buf[end + len(self.fmt.end_tag) :]
            self._in_block = False
            self._block(out, body)

    def finish(self) -> StreamedPart:
        """The output ended: what was held back (an unclosed block is content)."""
        out = StreamedPart()
        rest = self.fmt.start_tag + self._buf if self._in_block else self._buf
        self._buf, self._in_block = "", False
        self._content(out, rest)
        return out

    def _block(self, out: StreamedPart, body: str) -> None:
        found = self.fmt.parse_body(body)
        if found is None:
            self._content(out, self.fmt.start_tag + body + self.fmt.end_tag)
            return
        room = len(found) if self.max_calls is None else self.max_calls - self.num_calls
        taken = found[: max(0, room)]
        self.num_calls += len(taken)
        out.calls.extend(taken)

    def _content(self, out: StreamedPart, text: str) -> None:
        if not self._started:
            text = text.lstrip()
            if not text:
                return
            self._started = True
        text = self._space + text
        kept = text.rstrip()
        self._space = text[len(kept) :]
        out.content += kept
