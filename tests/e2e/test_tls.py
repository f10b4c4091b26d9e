"""TLS between controller and executors: mutual TLS and a shared token.

A controller with the CA, a client certificate and the token serves completions; the executor
refuses plaintext, clients without a certificate or with one from another CA, and calls
without the token (health checks excepted, and a plaintext health-only port serves probes).
Its step socket (--step-port), which the controller drives the steps over, has the same TLS
and token. The controller can also verify a chosen server name and serve HTTPS itself.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import socket
import ssl
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.step_frames import END, HEADER, HELLO, MAGIC, frame
from tests.e2e.helpers import https_client
from tests.support.processes import (
    free_port,
    spawn_controller,
    spawn_executor,
    start_server,
    wait_until,
)

TOKEN = "executor-token-0123456789"


def _make_certs(folder) -> dict[str, str]:
    """A CA, an executor certificate (127.0.0.1, localhost, executor.test), a controller
    client certificate, and a client certificate of an unrelated CA; PEM paths by name."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    paths: dict[str, str] = {}

    def write(name: str, data: bytes) -> str:
        path = os.path.join(folder, name)
        with open(path, "wb") as f:
            f.write(data)
        paths[name] = path
        return path

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )

    def issue(name: str, issuer_key, issuer_name, ca: bool, sans=(), usage=None):
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer_name or subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        if usage:
            builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        cert = builder.sign(issuer_key or key, hashes.SHA256())
        return key, cert

    pem = serialization.Encoding.PEM
    ca_key, ca = issue("tandem-test-ca", None, None, ca=True)
    write("ca.pem", ca.public_bytes(pem))
    sans = [
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.DNSName("localhost"),
        x509.DNSName("executor.test"),
    ]
    key, cert = issue("executor", ca_key, ca.subject, False, sans, ExtendedKeyUsageOID.SERVER_AUTH)
    write("executor.pem", cert.public_bytes(pem))
    write("executor.key", key_pem(key))
    key, cert = issue("controller", ca_key, ca.subject, False, (), ExtendedKeyUsageOID.CLIENT_AUTH)
    write("controller.pem", cert.public_bytes(pem))
    write("controller.key", key_pem(key))
    evil_key, evil_ca = issue("other-ca", None, None, ca=True)
    key, cert = issue(
        "intruder", evil_key, evil_ca.subject, False, (), ExtendedKeyUsageOID.CLIENT_AUTH
    )
    write("intruder.pem", cert.public_bytes(pem))
    write("intruder.key", key_pem(key))
    write("token", f"{TOKEN}\n".encode())
    write("wrong-token", b"not-the-token\n")
    return paths


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return _make_certs(str(tmp_path_factory.mktemp("certs")))


def _executor_tls_args(certs: dict) -> list[str]:
    """An executor serving gRPC over mTLS and requiring the token."""
    return [
        "--tls-cert",
        certs["executor.pem"],
        "--tls-key",
        certs["executor.key"],
        "--tls-client-ca",
        certs["ca.pem"],
        "--auth-token-file",
        certs["token"],
    ]


@pytest.fixture(scope="module")
def mtls_server(default_model_dir, tmp_path_factory, certs):
    health_port = free_port()
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("mtls")),
        executor_args=[*_executor_tls_args(certs), "--health-port", str(health_port)],
        step_sockets=True,
        controller_args=[
            "--executor-tls-ca",
            certs["ca.pem"],
            "--executor-tls-cert",
            certs["controller.pem"],
            "--executor-tls-key",
            certs["controller.key"],
            "--auth-token-file",
            certs["token"],
        ],
    )
    s.health_port = health_port
    yield s
    s.stop()


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _channel(address: str, certs: dict, client: str | None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(
        root_certificates=_read(certs["ca.pem"]),
        private_key=_read(certs[f"{client}.key"]) if client else None,
        certificate_chain=_read(certs[f"{client}.pem"]) if client else None,
    )
    return grpc.secure_channel(address, creds)


def _health(channel: grpc.Channel) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status


def test_completion_over_mtls_with_token(mtls_server):
    s = mtls_server
    r = s.client().completions.create(
        model=s.model_name, prompt="The capital of France is", max_tokens=6, temperature=0
    )
    assert r.choices[0].finish_reason in ("length", "stop") and r.choices[0].text
    # The steps went over the executor's step socket, under the same mTLS and token.
    assert [e["step_transport"] for e in s.executors_state()] == ["socket"]


def _socket_hello(port: int, certs: dict, client: str | None, token: str) -> bytes:
    """Connect the executor's step socket over TLS (presenting `client`'s certificate, if
    any), send a hello with `token`; the bytes the executor answers before closing."""
    context = ssl.create_default_context(cafile=certs["ca.pem"])
    if client:
        context.load_cert_chain(certs[f"{client}.pem"], certs[f"{client}.key"])
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            tls.sendall(MAGIC + frame(HELLO, pb.StepSocketHello(token=token).SerializeToString()))
            answer = b""
            while chunk := tls.recv(4096):
                answer += chunk
            return answer


def test_step_socket_refuses_plaintext_certless_clients_and_wrong_tokens(mtls_server, certs):
    port = mtls_server.executor_step_ports[0]
    # Plaintext: the executor waits for a TLS handshake and closes on these bytes.
    with socket.create_connection(("127.0.0.1", port), timeout=10) as plain:
        plain.sendall(MAGIC + frame(HELLO, b""))
        answer = b""
        try:
            while chunk := plain.recv(4096):  # at most a TLS alert, then the close
                answer += chunk
        except ConnectionResetError:
            pass
        assert answer[:1] in (b"", b"\x15"), answer  # nothing, or an alert record
    # TLS without a client certificate, or with another CA's: no stream.
    for client in (None, "intruder"):
        try:
            answer = _socket_hello(port, certs, client, TOKEN)
        except (ssl.SSLError, ConnectionResetError):
            continue
        assert answer == b"", client
    # The controller's certificate with a wrong token: one END frame, UNAUTHENTICATED.
    answer = _socket_hello(port, certs, "controller", "not-the-token")
    length, kind = HEADER.unpack(answer[: HEADER.size])
    assert kind == END
    end = pb.StepSocketEnd.FromString(answer[HEADER.size : HEADER.size + length])
    assert end.code == "UNAUTHENTICATED"
    # The serving controller's socket stream was never disturbed.
    r = mtls_server.client().completions.create(
        model=mtls_server.model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert r.choices[0].text is not None


def test_executor_refuses_clients_without_a_valid_certificate(mtls_server, certs):
    address = f"127.0.0.1:{mtls_server.executor_ports[0]}"
    with grpc.insecure_channel(address) as plain:
        with pytest.raises(grpc.RpcError) as exc:
            _health(plain)
        assert exc.value.code() == grpc.StatusCode.UNAVAILABLE
    for client in (None, "intruder"):
        with _channel(address, certs, client) as channel:
            with pytest.raises(grpc.RpcError) as exc:
                _health(channel)
            assert exc.value.code() == grpc.StatusCode.UNAVAILABLE, client


def test_executor_refuses_calls_without_the_token(mtls_server, certs):
    address = f"127.0.0.1:{mtls_server.executor_ports[0]}"
    with _channel(address, certs, "controller") as channel:
        # Health checks need no token (probes carry no metadata).
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        stub = pb_grpc.ExecutorStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as exc:
                stub.ProfileMemory(pb.ProfileMemoryRequest(), timeout=10, metadata=metadata)
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
            with pytest.raises(grpc.RpcError) as exc:
                list(stub.ExecuteModel(iter([pb.StepRequest()]), timeout=10, metadata=metadata))
            assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED, metadata
    # The plaintext health-only port serves probes and nothing else.
    with grpc.insecure_channel(f"127.0.0.1:{mtls_server.health_port}") as plain:
        assert _health(plain) == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as exc:
            pb_grpc.ExecutorStub(plain).ProfileMemory(pb.ProfileMemoryRequest(), timeout=10)
        assert exc.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The serving controller was never disturbed.
    r = mtls_server.client().completions.create(
        model=mtls_server.model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert r.choices[0].text is not None


def test_controller_with_a_wrong_token_never_connects(
    mtls_server, certs, default_model_dir, tmp_path
):
    port = mtls_server.executor_ports[0]
    bad = spawn_controller(
        default_model_dir,
        str(tmp_path),
        [
            "--executor",
            f"127.0.0.1:{port}",
            "--executor-tls-ca",
            certs["ca.pem"],
            "--executor-tls-cert",
            certs["controller.pem"],
            "--executor-tls-key",
            certs["controller.key"],
            "--auth-token-file",
            certs["wrong-token"],
        ],
    )
    try:

        def refused():
            state = bad.executors_state()
            return state and "UNAUTHENTICATED" in str(state)

        wait_until(refused, 60, "the executor to refuse the wrong token", logs=str(tmp_path))
        assert httpx.get(bad.base_url + "/health", timeout=5).status_code == 503
        time.sleep(1)
        assert not any(e["healthy"] for e in bad.executors_state())
    finally:
        bad.stop()
    r = mtls_server.client().completions.create(
        model=mtls_server.model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert r.choices[0].text is not None


def test_server_name_override_and_https(mtls_server, certs, default_model_dir, tmp_path):
    """A second controller verifies the name executor.test (not the address) and serves
    HTTPS with the executor's certificate. It drives an executor of its own (a simulated one
    over the same mTLS): the first controller's executor is its own while its lease lives."""
    executor, port = spawn_executor(
        "executor_sim", default_model_dir, str(tmp_path), "sim", extra=_executor_tls_args(certs)
    )
    second = spawn_controller(
        default_model_dir,
        str(tmp_path),
        [
            "--executor",
            f"127.0.0.1:{port}",
            "--executor-tls-ca",
            certs["ca.pem"],
            "--executor-tls-cert",
            certs["controller.pem"],
            "--executor-tls-key",
            certs["controller.key"],
            "--executor-tls-server-name",
            "executor.test",
            "--auth-token-file",
            certs["token"],
            "--ssl-certfile",
            certs["executor.pem"],
            "--ssl-keyfile",
            certs["executor.key"],
        ],
    )
    try:
        with https_client(second, certs["ca.pem"], str(tmp_path)) as (https, url):
            r = https.post(url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3})
            assert r.status_code == 200 and r.json()["choices"][0]["text"] is not None
        with pytest.raises(httpx.HTTPError):
            httpx.get(second.base_url + "/health", timeout=5)  # plain HTTP is not served
    finally:
        second.stop()
        executor.kill()
        executor.wait()
    r = mtls_server.client().completions.create(
        model=mtls_server.model_name, prompt="Hi", max_tokens=2, temperature=0
    )
    assert r.choices[0].text is not None  # the first controller was never disturbed
