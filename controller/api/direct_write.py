"""Writing a streamed response's plain chunks to its connection from the step loop itself.

A streamed token otherwise costs a wake-up of the response's task and a trip down the ASGI
`send` chain (Starlette's middlewares, ours, uvicorn's request cycle) per request per step. When
the response's writer is idle (it waits for output, so every chunk it took has been written)
and the connection takes data without waiting, the step loop can write the chunk itself, in
the HTTP/1.1 chunked framing uvicorn uses for the response: one `transport.write` per request
per step, nothing else. Whatever cannot go that way (a finished or failed delta, logprobs,
tools, a paused or closed connection) takes the ordinary path, through the response's task,
where every write is bounded by the stall timeout.

Only connections of the controller's own HTTP protocol (`http_guard.py`) carry the extension;
under any other server the ordinary path is the only one.
"""

from __future__ import annotations

from typing import Any

from controller.api.sse import framed

EXTENSION = "tandem.direct_write"  # the ASGI scope extension naming the request's DirectWrite


class DirectWrite:
    """One request's response body written to its connection past the ASGI chain: valid while
    uvicorn's request cycle says the chunked body is open and its connection writable."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Any):
        self.cycle = cycle  # uvicorn's RequestResponseCycle of the request

    def writable(self) -> bool:
        """Whether a chunk can be written now without waiting: the head is out, the body is
        chunked and open, the client connected and its socket's buffers below the high-water
        mark (else the ordinary, stall-bounded send waits for them)."""
        c = self.cycle
        return (
            c.response_started
            and c.chunked_encoding is True
            and not c.response_complete
            and not c.disconnected
            and not c.flow.write_paused
            and not c.transport.is_closing()
        )

    def write(self, body: bytes) -> None:
        """One chunk of the body, framed as uvicorn frames a ``more_body`` message's."""
        self.cycle.transport.write(framed(body))


def direct_write_of(scope: dict) -> DirectWrite | None:
    """The request's DirectWrite, when its server offers one."""
    extensions = scope.get("extensions") or {}
    return extensions.get(EXTENSION)
