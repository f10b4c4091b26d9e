"""API keys and admin keys: Bearer tokens on every HTTP route but a few exempt ones (probes,
scraping), and a separate gate on the admin routes.

API keys come from `--api-key` (repeatable), `--api-key-file` (one key per line; blank lines
and `#` comments skipped) and the TANDEM_API_KEY environment variable. Without any key the API
is open. A presented key is compared with every configured key in constant time (over SHA-256
digests, so neither the matching key nor key lengths show in the timing).

The admin routes (`/admin/*`: executor addresses, the fleet's and admission's details) take
admin keys only (`--admin-api-key`, `--admin-api-key-file`, TANDEM_ADMIN_API_KEY), never API
keys, and an admin key serves no API route: a client's key never shows the fleet, and the key
of a dashboard or an operator's script never spends compute. Without any admin key they answer
only clients connected directly over loopback (a shell on the host or in the pod, `kubectl
port-forward`), and 403 to everyone else.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress

from controller.api.errors import APIError, error_response

DEFAULT_EXEMPT_PATHS = ("/health", "/metrics")
# Served without a key whatever --auth-exempt-path says: the other controllers' liveness probe
# (controller/fleet/peers.py), which carries no key and reveals no executor address.
ALWAYS_EXEMPT_PATHS = ("/peer",)
ADMIN_PREFIX = "/admin/"  # the admin routes
# Request headers a proxy adds: a request carrying one did not come from this host itself,
# whatever its peer address says.
_PROXY_HEADERS = (b"forwarded", b"x-forwarded-for", b"x-real-ip", b"via")


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


def is_admin_path(path: str) -> bool:
    """Whether a path is an admin route (guarded by AdminAuth, not by API keys)."""
    return path.startswith(ADMIN_PREFIX) or path == ADMIN_PREFIX.rstrip("/")


def direct_loopback(scope) -> bool:
    """Whether the request came over a loopback connection with no proxy in between."""
    client = scope.get("client")
    if not client:
        return False  # a Unix socket or an unknown peer: not provably local
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        address = address.ipv4_mapped
    if not address.is_loopback:
        return False
    return not any(name in _PROXY_HEADERS for name, _ in scope.get("headers", ()))


_NO_API_KEY = (
    "You didn't provide an API key. Provide it in the Authorization header as 'Bearer YOUR_KEY'."
)
_NO_ADMIN_KEY = "Admin routes need an admin key in the Authorization header as 'Bearer ADMIN_KEY'."


def _key_error(checker: KeyChecker, scope, missing: str, wrong: str) -> APIError | None:
    """401 (with `missing` or `wrong` as its message) unless the request presents one of the
    checker's keys as its Bearer token; None when it does."""
    token = bearer_token(scope.get("headers", []))
    if token is None or not checker.valid(token):
        return APIError(
            missing if token is None else wrong,
            401,
            code="invalid_api_key",
            err_type="invalid_request_error",
            headers={"WWW-Authenticate": "Bearer"},
        )
    return None


async def _pass_or_refuse(app, err: APIError | None, scope, receive, send) -> None:
    """Hand the request to `app`, or answer `err` instead."""
    if err is None:
        await app(scope, receive, send)
    else:
        await error_response(err)(scope, receive, send)


class APIKeyAuth:
    """ASGI middleware: 401 (OpenAI's shape) unless a valid Bearer key is presented."""

    def __init__(self, app, keys: list[str], exempt_paths=DEFAULT_EXEMPT_PATHS):
        self.app = app  # the wrapped ASGI app
        self.checker = KeyChecker(keys)  # the configured keys
        self.exempt = frozenset(exempt_paths) | set(ALWAYS_EXEMPT_PATHS)  # served without a key

    async def __call__(self, scope, receive, send):
        if (
            scope["type"] != "http"
            or not self.checker
            or scope["path"] in self.exempt
            or is_admin_path(scope["path"])  # AdminAuth's
        ):
            await self.app(scope, receive, send)
            return
        err = _key_error(self.checker, scope, _NO_API_KEY, "Incorrect API key provided.")
        await _pass_or_refuse(self.app, err, scope, receive, send)


def _forbidden() -> APIError:
    return APIError(
        "Admin routes answer local clients only: set --admin-api-key to reach them remotely.",
        403,
        code="admin_forbidden",
        err_type="permission_error",
    )


class AdminAuth:
    """ASGI middleware on the admin routes: a valid admin key (401 otherwise) when admin keys
    are configured; without any, direct loopback clients only (403 otherwise)."""

    def __init__(self, app, keys: list[str]):
        self.app = app  # the wrapped ASGI app
        self.checker = KeyChecker(keys)  # the configured admin keys

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not is_admin_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        if not self.checker:
            err = None if direct_loopback(scope) else _forbidden()
        else:
            err = _key_error(self.checker, scope, _NO_ADMIN_KEY, "Incorrect admin key provided.")
        await _pass_or_refuse(self.app, err, scope, receive, send)
