"""TLS credentials for the controller <-> executor gRPC link, from PEM files.

An executor serves TLS with `server_credentials`; giving it a client CA turns on mutual TLS
(every client must present a certificate that CA signed). The controller connects with
`channel_credentials`: the CA that signs executor certificates, plus its own client certificate
and key for mutual TLS.
"""

from __future__ import annotations

import grpc


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str = ""
) -> grpc.ServerCredentials:
    """A TLS server's credentials; with `client_ca_file`, client certificates are required."""
    pair = [(_read(key_file), _read(cert_file))]
    if client_ca_file:
        return grpc.ssl_server_credentials(
            pair, root_certificates=_read(client_ca_file), require_client_auth=True
        )
    return grpc.ssl_server_credentials(pair)


def channel_credentials(
    ca_file: str, cert_file: str = "", key_file: str = ""
) -> grpc.ChannelCredentials:
    """A TLS client's credentials: trust `ca_file`; present cert/key when both are given."""
    if bool(cert_file) != bool(key_file):
        raise ValueError("a client certificate needs both its certificate and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(ca_file),
        private_key=_read(key_file) if key_file else None,
        certificate_chain=_read(cert_file) if cert_file else None,
    )
