"""The step socket's framing: ExecuteModel's messages on a plain TCP (or TLS) stream.

gRPC costs the controller ~0.2 ms of CPU per step on its own (its poller thread hands every
write and read to the event loop), which at a 10 ms step and 64 requests is more than the
scheduling itself. An executor may therefore also serve its steps on a socket of its own
(Capabilities.step_socket_port): the same StepRequest and StepResult messages, each in one
frame, read and written by the event loop directly.

A connection starts with MAGIC, then the controller's HELLO frame (pb.StepSocketHello: the
token and session generation an ExecuteModel call carries as metadata), then STEP frames; the
executor answers each with a RESULT frame, in order. An executor that ends the stream with an
error sends one END frame (pb.StepSocketEnd: a gRPC status name and details) and closes. A
frame is its HEADER (payload length, kind) and the serialized message. Every length is checked
against a bound before anything is read into memory.
"""

from __future__ import annotations

import struct

MAGIC = b"TDS1"  # the first bytes a controller sends: the protocol and its version
HEADER = struct.Struct("<IB")  # payload length (uint32, little-endian), frame kind (uint8)

HELLO = 1  # controller -> executor, once, first: pb.StepSocketHello
STEP = 2  # controller -> executor: pb.StepRequest
RESULT = 3  # executor -> controller: pb.StepResult
END = 4  # executor -> controller, last: pb.StepSocketEnd

MAX_HELLO_BYTES = 16 * 1024  # a hello holds a token and a number
MAX_END_BYTES = 64 * 1024  # a status and its details


class FrameError(ValueError):
    """Bytes that are not a frame this side accepts (wrong magic, kind or length)."""


def frame(kind: int, payload: bytes) -> bytes:
    """One frame: the header, then the payload."""
    return HEADER.pack(len(payload), kind) + payload


def parse_header(header: bytes, kinds: dict[int, int]) -> tuple[int, int]:
    """(length, kind) of a frame's header; FrameError unless `kind` is one of `kinds` and its
    length is at most the bound `kinds` gives it."""
    length, kind = HEADER.unpack(header)
    bound = kinds.get(kind)
    if bound is None:
        raise FrameError(f"unexpected frame kind {kind}")
    if length > bound:
        raise FrameError(f"a frame of kind {kind} of {length} bytes is over its {bound} bytes")
    return length, kind
