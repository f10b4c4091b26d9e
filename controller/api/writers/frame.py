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
    parts = (frame.slots, frame.counts, frame.token_ids, frame.finish)
    return head + b"".join(_bytes(p) for p in parts)


def decode_step(message: bytes) -> StepFrame:
    """The StepFrame of a STEP message (ValueError when its size disagrees with its head)."""
    kind, n, t = _HEAD.unpack_from(message)
    if kind != STEP:
        raise ValueError(f"not a step frame: kind {kind}")
    size = _HEAD.size + 4 * n + 4 * n + 4 * t + n
    if len(message) != size:
        raise ValueError(f"a step frame of {len(message)} bytes, its head says {size}")
    view, at = memoryview(message), _HEAD.size
    slots = _array("I", view[at : at + 4 * n])
    counts = _array("I", view[at + 4 * n : at + 8 * n])
    at += 8 * n
    token_ids = _array("i", view[at : at + 4 * t])
    finish = _array("B", view[at + 4 * t :])
    return StepFrame(slots, counts, finish, token_ids)


def step_size(sequences: int, tokens: int) -> int:
    """Bytes of a STEP message for this many sequences and token ids."""
    return _HEAD.size + 9 * sequences + 4 * tokens


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
    sequence's new ids as it goes; `take` hands the frame out and starts the next)."""

    __slots__ = ("slots", "counts", "finish", "token_ids")

    def __init__(self) -> None:
        self.slots = array("I")  # as in StepFrame
        self.counts = array("I")
        self.finish = array("B")
        self.token_ids = array("i")

    def add(self, slot: int, token_ids: list[int], finish_reason: str | None = None) -> None:
        """One sequence's new ids (and its end, when it ended this step)."""
        self.slots.append(slot)
        self.counts.append(len(token_ids))
        self.finish.append(FINISH_CODES[finish_reason])
        self.token_ids.extend(token_ids)

    def __len__(self) -> int:
        return len(self.slots)

    def take(self) -> bytes:
        """The STEP message of what was added, and a fresh builder state."""
        frame = StepFrame(self.slots, self.counts, self.finish, self.token_ids)
        self.__init__()
        return encode_step(frame)
