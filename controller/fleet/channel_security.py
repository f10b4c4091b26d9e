"""How the controller reaches executors: TLS (mutual with a client certificate) and a shared
token, for the gRPC channel and the step socket alike."""

from __future__ import annotations

import ssl
from dataclasses import dataclass, field

import grpc

from common.wire.rpc_token import token_metadata


@dataclass
class ChannelSecurity:
    """How the controller reaches executors: TLS (with a client certificate for mTLS) and a
    shared token."""

    credentials: grpc.ChannelCredentials | None = None  # TLS credentials; None = plaintext
    server_name: str = ""  # name to verify in executor certificates; "" = the address's host
    metadata: tuple = field(default_factory=tuple)  # sent on every RPC (the token)
    ssl_context: ssl.SSLContext | None = None  # the same TLS for step sockets; None = plaintext
    token: str = ""  # the shared token, for step sockets' hellos ("" = none)


def make_security(
    ca_file: str = "",
    cert_file: str = "",
    key_file: str = "",
    server_name: str = "",
    token: str = "",
) -> ChannelSecurity:
    """ChannelSecurity from PEM files and a token ("" = off)."""
    from common.wire.tls import channel_credentials

    if (cert_file or key_file or server_name) and not ca_file:
        raise ValueError("executor TLS options need the CA (--executor-tls-ca)")
    creds = channel_credentials(ca_file, cert_file, key_file) if ca_file else None
    context = None
    if ca_file:  # the same trust and client certificate as the channel's
        context = ssl.create_default_context(cafile=ca_file)
        if cert_file:
            context.load_cert_chain(cert_file, key_file)
    return ChannelSecurity(creds, server_name, token_metadata(token), context, token)
