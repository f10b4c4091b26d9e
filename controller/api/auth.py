"""API keys: Bearer tokens on every HTTP route but a few exempt ones (probes, scraping).

Keys come from `--api-key` (repeatable), `--api-key-file` (one key per line; blank lines and
`#` comments skipped) and the TANDEM_API_KEY environment variable. Without any key the API is
open. A presented key is compared with every configured key in constant time (over SHA-256
digests, so neither the matching key nor key lengths show in the timing).
"""

from __future__ import annotations

import hashlib
import hmac

from controller.api.errors import APIError, error_response

DEFAULT_EXEMPT_PATHS = ("/health", "/metrics")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


class KeyChecker:
    """Constant-time membership test of a presented key among the configured ones."""

    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]  # never the keys themselves

    def __bool__(self) -> bool:
        return bool(self._digests)

    def valid(self, presented: str) -> bool:
        """Whether `presented` is a configured key; compares against all of them."""
        candidate = _digest(presented)
        ok = False
        for digest in self._digests:
            ok |= hmac.compare_digest(digest, candidate)
        return ok


def bearer_token(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, if there is one."""
    for name, value in headers:
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def _unauthorized(message: str) -> APIError:
    return APIError(
        message,
        401,
        code="invalid_api_key",
        err_type="invalid_request_error",
        headers={"WWW-Authenticate": "Bearer"},
    )


class APIKeyAuth:
    """ASGI middleware: 401 (OpenAI's shape) unless a valid Bearer key is presented."""

    def __init__(self, app, keys: list[str], exempt_paths=DEFAULT_EXEMPT_PATHS):
        self.app = app  # the wrapped ASGI app
        self.checker = KeyChecker(keys)  # the configured keys
        self.exempt = frozenset(exempt_paths)  # paths served without a key

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.checker or scope["path"] in self.exempt:
            await self.app(scope, receive, send)
            return
        token = bearer_token(scope.get("headers", []))
        if token is None:
            err = _unauthorized(
                "You didn't provide an API key. Provide it in the "
                "Authorization header as 'Bearer YOUR_KEY'."
            )
        elif not self.checker.valid(token):
            err = _unauthorized("Incorrect API key provided.")
        else:
            await self.app(scope, receive, send)
            return
        await error_response(err)(scope, receive, send)
