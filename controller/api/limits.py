"""A bound on HTTP request bodies (413 beyond it), as ASGI middleware.

The body is read before the app sees it, so an oversized upload is refused without parsing
it; the app then reads the buffered body, and later receive calls (disconnect detection) go
to the client connection.
"""

from __future__ import annotations

from controller.api.errors import APIError, error_response


def _too_large(limit: int) -> APIError:
    return APIError(
        f"The request body is larger than {limit} bytes.", 413, code="request_too_large"
    )


class BodySizeLimit:
    """Refuse HTTP requests whose body exceeds `max_bytes` with an OpenAI-style 413."""

    def __init__(self, app, max_bytes: int):
        self.app = app  # the wrapped ASGI app
        self.max_bytes = max_bytes  # largest accepted body; 0 = no bound

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.max_bytes:
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    declared = 0
                if declared > self.max_bytes:
                    await error_response(_too_large(self.max_bytes))(scope, receive, send)
                    return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left before sending its body: let the app see the disconnect.
                await self.app(scope, _replay([], message, receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await error_response(_too_large(self.max_bytes))(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(chunks, None, receive), send)


def _replay(chunks: list[bytes], pending: dict | None, receive):
    """A receive callable that first returns the buffered body (or a pending message)."""
    first = [pending or {"type": "http.request", "body": b"".join(chunks), "more_body": False}]

    async def replay():
        if first:
            return first.pop()
        return await receive()

    return replay
