"""The messages between the scheduling core and a stream writer process, packed with `struct`
and `array`.

One message is one datagram of a SOCK_SEQPACKET Unix socket (boundaries kept by the kernel,
an OPEN's connection fd in its ancillary data). Its first byte says its kind:

- OPEN (core -> writer): a stream's slot, its sequences' slots and the JSON meta the writer
  needs to format its chunks; the client's socket fd rides along (SCM_RIGHTS).
- STEP (core -> writer): one per step for all of the writer's sequences that moved, as packed
  arrays, so that no per-token Python object crosses: the sequence slots (uint32), their
  token counts (uint32), their finish codes (uint8, FINISH_REASONS) and the token ids
  (int32), concatenated in slot order.
- CLOSE (core -> writer): drop a stream now (its request was aborted by the core); with
  extra 1 (END_ABORTED), end it as the in-process path ends an aborted response instead (each
  unfinished sequence's "abort" chunk, the usage chunk, [DONE]), then DONE "finished".
- USAGE (core -> writer): a sequence's prompt tokens served from the prefix cache (for the
  usage chunk), sent at its first tokens and at its end, before the STEP that carries them.
- STOPPED (writer -> core): a stop string the writer found ended this sequence (its slot):
  the core finishes its request as "stop" and frees its blocks.
- ERROR (core -> writer): a sequence failed: its slot and the SSE event that says why (the
  in-process path's `data: {"error": ...}` bytes); it ends there.
- DONE (writer -> core): a stream is over and its fd closed, with why (DONE_REASONS); the
  core finishes the HTTP response and resumes the connection.
"""

from __future__ import annotations

import json
import struct
import sys
from array import array
from dataclasses import dataclass
from typing import Any

from common.wire.step_types import TokenLogprobs

OPEN, STEP, CLOSE, DONE, STOPPED, USAGE, ERROR = 1, 2, 3, 4, 5, 6, 7  # a message's first byte

# A sequence's finish code in a STEP (0: it goes on) and its OpenAI finish_reason.
FINISH_REASONS = (None, "stop", "length", "abort", "error")
FINISH_CODES = {reason: code for code, reason in enumerate(FINISH_REASONS)}

# Why a stream ended, in a DONE: the core aborts whatever of it still runs for all but
# "finished" (its sequences ended with the core's finish codes or STOPPED).
DONE_REASONS = ("finished", "client_gone", "stalled", "closed", "error")

END_ABORTED = 1  # a CLOSE's extra: write the aborted response's last chunks first

_HEAD = struct.Struct("<BII")  # kind, sequences, tokens (STEP); kind, slot, extra (others)
HEAD_SIZE = _HEAD.size  # bytes before a message's payload
_LITTLE = sys.byteorder == "little"  # arrays are sent little-endian whatever the host


@dataclass
class StepFrame:
    """One step's output for one writer's sequences (every array as long as `slots`, but
    `token_ids`, which holds `counts[i]` ids for `slots[i]`, in order)."""

    slots: array  # 'I': the sequences' slots (OPEN's `sequences`)
    counts: array  # 'I': how many new token ids each one has in `token_ids`
    finish: array  # 'B': FINISH_REASONS code each, 0 while it goes on
    token_ids: array  # 'i': the new token ids, sequence after sequence
    logprobs: StepLogprobs | None = None  # present when a sequence of the step asked for them


@dataclass
class StepLogprobs:
    """A STEP's logprobs section: per sequence, how many entries (TokenLogprobs) it has, then
    the entries of all sequences in order, each with its top alternatives."""

    entries: array  # 'I': entries per sequence (as long as the frame's `slots`; 0: none)
    token_ids: array  # 'i': each entry's token
    values: array  # 'f': each entry's logprob (float32, as the executors send it)
    top_counts: array  # 'H': each entry's number of alternatives
    top_ids: array  # 'i': the alternatives' tokens, entry after entry, best first
    top_values: array  # 'f': their logprobs

    @classmethod
    def empty(cls) -> StepLogprobs:
        """A section with nothing in it yet."""
        return cls(array("I"), array("i"), array("f"), array("H"), array("i"), array("f"))

    def parts(self) -> tuple[array, ...]:
        """Its arrays in the order they are sent."""
        return (
            self.entries,
            self.token_ids,
            self.values,
            self.top_counts,
            self.top_ids,
            self.top_values,
        )

    def of(self, seq_index: int, entry_at: int, top_at: int) -> tuple[list, int, int]:
        """The TokenLogprobs of the frame's `seq_index`th sequence, whose entries start at
        `entry_at` and alternatives at `top_at`, and where the next sequence's start."""
        out = []
        for k in range(entry_at, entry_at + self.entries[seq_index]):
            count = self.top_counts[k]
            top = slice(top_at, top_at + count)
            out.append(
                TokenLogprobs(
                    self.token_ids[k],
                    self.values[k],
                    0,  # the rank: no chunk shows it
                    self.top_ids[top].tolist(),
                    self.top_values[top].tolist(),
                )
            )
            top_at += count
        return out, entry_at + self.entries[seq_index], top_at


def _bytes(values: array) -> bytes:
    if not _LITTLE:
        values = array(values.typecode, values)
        values.byteswap()
    return values.tobytes()


def _array(typecode: str, data: memoryview) -> array:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values


def encode_step(frame: StepFrame) -> bytes:
    """A STEP message: the head, then the slots, counts, token ids and finish codes."""
    n = len(frame.slots)
    if not (len(frame.counts) == len(frame.finish) == n):
        raise ValueError("a step frame's slots, counts and finish codes differ in length")
    if sum(frame.counts) != len(frame.token_ids):
        raise ValueError("a step frame's counts do not add up to its token ids")
    head = _HEAD.pack(STEP, n, len(frame.token_ids))
    parts = [frame.slots, frame.counts, frame.token_ids, frame.finish]
    lps = frame.logprobs
    if lps is not None:
        if len(lps.entries) != n or sum(lps.entries) != len(lps.token_ids):
            raise ValueError("a step frame's logprobs do not match its sequences")
        if not (len(lps.token_ids) == len(lps.values) == len(lps.top_counts)):
            raise ValueError("a step frame's logprob entries differ in length")
        if not (sum(lps.top_counts) == len(lps.top_ids) == len(lps.top_values)):
            raise ValueError("a step frame's top logprobs do not add up")
        parts += lps.parts()
    return head + b"".join(_bytes(p) for p in parts)


def decode_step(message: bytes) -> StepFrame:
    """The StepFrame of a STEP message (ValueError when its size disagrees with its head)."""
    kind, n, t = _HEAD.unpack_from(message)
    if kind != STEP:
        raise ValueError(f"not a step frame: kind {kind}")
    size = step_size(n, t)
    if len(message) != size and len(message) < size + 4 * n:
        raise ValueError(f"a step frame of {len(message)} bytes, its head says {size}")
    view, at = memoryview(message), _HEAD.size
    slots = _array("I", view[at : at + 4 * n])
    counts = _array("I", view[at + 4 * n : at + 8 * n])
    at += 8 * n
    token_ids = _array("i", view[at : at + 4 * t])
    finish = _array("B", view[at + 4 * t : size])
    frame = StepFrame(slots, counts, finish, token_ids)
    if len(message) > size:
        frame.logprobs = _decode_logprobs(view[size:], n)
    return frame


def _decode_logprobs(view: memoryview, n: int) -> StepLogprobs:
    """A STEP's logprobs section (ValueError when its size disagrees with its counts)."""
    entries = _array("I", view[: 4 * n])
    e = sum(entries)
    at = 4 * n
    if len(view) < at + 10 * e:
        raise ValueError("a step frame's logprobs section is cut")
    ids = _array("i", view[at : at + 4 * e])
    values = _array("f", view[at + 4 * e : at + 8 * e])
    top_counts = _array("H", view[at + 8 * e : at + 10 * e])
    at += 10 * e
    m = sum(top_counts)
    if len(view) != at + 8 * m:
        raise ValueError("a step frame's logprobs section disagrees with its counts")
    top_ids = _array("i", view[at : at + 4 * m])
    top_values = _array("f", view[at + 4 * m :])
    return StepLogprobs(entries, ids, values, top_counts, top_ids, top_values)


def step_size(sequences: int, tokens: int, entries: int | None = None, tops: int = 0) -> int:
    """Bytes of a STEP message for this many sequences and token ids (and, with a logprobs
    section, its entries and their alternatives)."""
    size = _HEAD.size + 9 * sequences + 4 * tokens
    if entries is not None:
        size += 4 * sequences + 10 * entries + 8 * tops
    return size


def encode_open(slot: int, meta: dict[str, Any]) -> bytes:
    """An OPEN message: the stream's slot and its meta (StreamMeta's fields, as JSON)."""
    return _HEAD.pack(OPEN, slot, 0) + json.dumps(meta).encode()


def encode_control(kind: int, slot: int, extra: int = 0) -> bytes:
    """A CLOSE (extra: 0 or END_ABORTED), STOPPED (extra unused), DONE (extra: the
    DONE_REASONS index) or USAGE (slot: the sequence's, extra: its cached prompt tokens)
    message."""
    return _HEAD.pack(kind, slot, extra)


def encode_error(slot: int, event: bytes) -> bytes:
    """An ERROR message: the failed sequence's slot and its SSE error event."""
    return _HEAD.pack(ERROR, slot, 0) + event


def decode_head(message: bytes) -> tuple[int, int, int]:
    """A message's kind, slot (sequences, for STEP) and extra (tokens, for STEP)."""
    return _HEAD.unpack_from(message)


def decode_open(message: bytes) -> tuple[int, dict[str, Any]]:
    """An OPEN message's slot and meta."""
    _, slot, _ = _HEAD.unpack_from(message)
    return slot, json.loads(bytes(message[_HEAD.size :]))


class StepBuilder:
    """A writer's STEP being gathered over one step's updates (the step loop adds each
    sequence's new ids as it goes; `take_all` hands the messages out and starts the next)."""

    __slots__ = ("slots", "counts", "finish", "token_ids", "logprobs")

    def __init__(self) -> None:
        self.slots = array("I")  # as in StepFrame
        self.counts = array("I")
        self.finish = array("B")
        self.token_ids = array("i")
        self.logprobs: StepLogprobs | None = None  # made at the first sequence that has some

    def add(
        self,
        slot: int,
        token_ids: list[int],
        finish_reason: str | None = None,
        logprobs: list[TokenLogprobs] | None = None,
    ) -> None:
        """One sequence's new ids (and its end, when it ended this step; its logprobs, when
        it asked for them)."""
        self.slots.append(slot)
        self.counts.append(len(token_ids))
        self.finish.append(FINISH_CODES[finish_reason])
        self.token_ids.extend(token_ids)
        lps = self.logprobs
        if logprobs is None and lps is None:
            return
        if lps is None:  # the sequences before this one had none
            lps = self.logprobs = StepLogprobs.empty()
            lps.entries.extend([0] * (len(self.slots) - 1))
        lps.entries.append(len(logprobs or ()))
        for lp in logprobs or ():
            lps.token_ids.append(lp.token_id)
            lps.values.append(lp.logprob)
            lps.top_counts.append(len(lp.top_token_ids))
            lps.top_ids.extend(lp.top_token_ids)
            lps.top_values.extend(lp.top_logprobs)

    def __len__(self) -> int:
        return len(self.slots)

    def size(self) -> int:
        """Bytes of the STEP message of what was added."""
        lps = self.logprobs
        if lps is None:
            return step_size(len(self.slots), len(self.token_ids))
        entries, tops = len(lps.token_ids), len(lps.top_ids)
        return step_size(len(self.slots), len(self.token_ids), entries, tops)

    def take(self) -> bytes:
        """The STEP message of what was added, and a fresh builder state."""
        frame = StepFrame(self.slots, self.counts, self.finish, self.token_ids, self.logprobs)
        self.__init__()
        return encode_step(frame)

    def take_all(self, limit: int) -> list[bytes]:
        """What was added as STEP messages of at most `limit` bytes each (one, unless the step
        is that large: then split between sequences, in order, and a sequence too large for
        one message alone between its tokens), and a fresh builder state."""
        if self.size() <= limit:
            return [self.take()]
        frame = StepFrame(self.slots, self.counts, self.finish, self.token_ids, self.logprobs)
        self.__init__()
        return split_step(frame, limit)


def split_step(frame: StepFrame, limit: int) -> list[bytes]:
    """A step's frame as STEP messages of at most `limit` bytes each, in sequence order."""
    out: list[bytes] = []
    part = StepBuilder()
    at = entry_at = top_at = 0
    for i, (slot, count, code) in enumerate(zip(frame.slots, frame.counts, frame.finish)):
        ids = frame.token_ids[at : at + count].tolist()
        at += count
        lps = None
        if frame.logprobs is not None:
            lps, entry_at, top_at = frame.logprobs.of(i, entry_at, top_at)
        reason = FINISH_REASONS[code]
        alone = StepBuilder()
        alone.add(slot, ids, reason, lps)
        grow = alone.size() - step_size(0, 0)  # its bytes in a message with others
        if lps is not None and part.logprobs is None:
            grow += 4 * len(part)  # the others' entry counts, 0 each
        if len(part) and part.size() + grow > limit:
            out.append(part.take())
        if alone.size() > limit:  # one sequence too large for a message: between its tokens
            out.extend(_split_sequence(slot, ids, reason, lps, limit))
            continue
        part.add(slot, ids, reason, lps)
    if len(part):
        out.append(part.take())
    return out


def _split_sequence(
    slot: int, ids: list[int], reason: str | None, lps: list | None, limit: int
) -> list[bytes]:
    """One sequence's step as several STEPs (its end in the last): its tokens in pieces, each
    with its logprobs when it has one entry per token (otherwise they go with the last)."""
    aligned = lps is not None and len(lps) == len(ids)
    base = step_size(1, 0) + (4 if lps is not None else 0)  # a piece with no tokens
    if lps is not None and not aligned:  # every piece keeps room for them all (the last has them)
        base += sum(10 + 8 * len(lp.top_token_ids) for lp in lps)
    out, start, size = [], 0, base
    for k in range(len(ids) + 1):
        last = k == len(ids)
        grow = 0 if last else 4 + (10 + 8 * len(lps[k].top_token_ids) if aligned else 0)
        if last and k == start and reason is None:
            break  # the pieces so far hold it all
        if last or (k > start and size + grow > limit):
            piece = StepBuilder()
            end_lps = lps[start:k] if aligned else (lps if last else None)
            piece.add(slot, ids[start:k], reason if last else None, end_lps)
            out.append(piece.take())
            start, size = k, base
        size += grow
    return out
