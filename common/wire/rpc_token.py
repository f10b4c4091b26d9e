"""A shared token on the controller <-> executor gRPC link.

The controller sends `authorization: Bearer <token>` metadata on every RPC; an executor with a
token refuses any other call with UNAUTHENTICATED. Health checks stay open so probes (Kubernetes
gRPC probes carry no metadata) keep working. Tokens are compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac

import grpc

HEALTH_PREFIX = "/grpc.health.v1.Health/"  # methods every caller may use


def read_token(path: str) -> str:
    """The token in a file (its first non-blank line)."""
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                return line.strip()
    raise ValueError(f"{path} holds no token")


def token_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying `token` (empty without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class TokenInterceptor(grpc.ServerInterceptor):
    """Server interceptor: calls without the right Bearer token end UNAUTHENTICATED."""

    def __init__(self, token: str, exempt_prefixes: tuple[str, ...] = (HEALTH_PREFIX,)):
        self._expected = _digest(f"Bearer {token}")  # digest of the one accepted value
        self._exempt = exempt_prefixes  # method prefixes served without a token

    def _authorized(self, metadata) -> bool:
        presented = ""
        for key, value in metadata or ():
            if key == "authorization":
                presented = value if isinstance(value, str) else value.decode("latin-1")
        return hmac.compare_digest(self._expected, _digest(presented))

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(self._exempt) or self._authorized(
            handler_call_details.invocation_metadata
        ):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return _refusing(handler)


def _deny(request_or_iterator, context):
    context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong executor token")


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape as `handler` that refuses the call."""
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(_deny, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(_deny, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(_deny, **kw)
    return grpc.stream_stream_rpc_method_handler(_deny, **kw)
