"""The controller's end of an executor's step socket (common/wire/step_frames.py).

The steps' messages are ExecuteModel's, written and read by the event loop itself on one TCP
(or TLS) connection: no gRPC poller thread, no per-message hand-off to the loop. The executor
ends the stream with an END frame carrying the gRPC status ExecuteModel would end with.
"""

from __future__ import annotations

import asyncio
import ssl

from google.protobuf.message import DecodeError

from common.wire.pb import executor_pb2 as pb
from common.wire.step_frames import (
    END,
    HEADER,
    HELLO,
    MAGIC,
    MAX_END_BYTES,
    RESULT,
    STEP,
    FrameError,
    frame,
    parse_header,
)


class StepSocketError(Exception):
    """The step socket ended: the executor's status (`code`: a gRPC status name), or
    UNAVAILABLE when the connection broke."""

    def __init__(self, code: str, details: str):
        super().__init__(f"{code}: {details}")
        self.code = code  # a gRPC status code's name
        self.details = details  # why


def split_address(address: str) -> str:
    """The host of a "host:port" address (IPv6 brackets removed)."""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


class StepSocket:
    """One open step socket: send steps, receive their results in order."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, max_result_bytes: int
    ):
        self._reader = reader  # the executor's frames
        self._writer = writer  # ours
        self._kinds = {RESULT: max_result_bytes, END: MAX_END_BYTES}  # what may come, how big

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        token: str = "",
        generation: int = 0,
        ssl_context: ssl.SSLContext | None = None,
        server_hostname: str = "",
        timeout: float = 5.0,
        max_result_bytes: int = 256 * 1024 * 1024,
    ) -> StepSocket:
        """Connect (TLS when `ssl_context` is given, verifying `server_hostname` or `host`)
        and send the hello; OSError (ssl.SSLError included) or TimeoutError if it cannot."""
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(
                host,
                port,
                ssl=ssl_context,
                server_hostname=(server_hostname or host) if ssl_context is not None else None,
            )
        hello = pb.StepSocketHello(token=token, generation=generation)
        writer.write(MAGIC + frame(HELLO, hello.SerializeToString()))
        return cls(reader, writer, max_result_bytes)

    def send(self, payload: bytes) -> None:
        """Queue one serialized StepRequest for sending (the controller bounds the steps in
        flight, so the send buffer is bounded too)."""
        self._writer.write(frame(STEP, payload))

    async def receive(self) -> pb.StepResult:
        """The next result; StepSocketError when the executor ended the stream or the
        connection broke."""
        try:
            length, kind = parse_header(await self._reader.readexactly(HEADER.size), self._kinds)
            payload = await self._reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise StepSocketError("UNAVAILABLE", "the executor closed the step socket") from exc
        except (ConnectionError, FrameError) as exc:
            raise StepSocketError("UNAVAILABLE", f"the step socket broke: {exc}") from exc
        try:
            if kind == END:
                end = pb.StepSocketEnd.FromString(payload)
                raise StepSocketError(end.code or "UNKNOWN", end.details)
            return pb.StepResult.FromString(payload)
        except DecodeError as exc:
            raise StepSocketError("INTERNAL", f"a frame that does not parse: {exc}") from exc

    def close(self) -> None:
        """Close the connection (the executor's stream ends as a cancelled call would)."""
        self._writer.close()
