"""The executor's step socket: ExecuteModel served on a TCP port of its own, without gRPC.

The frames are common/wire/step_frames.py's; the steps run through the same servicer method
(`ExecutorServicer.ExecuteModel`) as the gRPC stream, through a small stand-in for gRPC's call
context: the same sessions, fencing, replacement of an older stream, device-failure handling
and pipelined steps. The security is the gRPC port's: TLS with the same certificate (and
client CA: mutual TLS), and the same token, carried in the hello.

A connection costs nothing before it is authenticated beyond its bounded hello: at most
`max_connections` are open at once (others are closed at once), the magic and hello must
arrive within `hello_timeout` seconds, and every frame's length is checked against its bound
before it is read.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import socket
import ssl
import threading
import time
from collections.abc import Iterator

import grpc
from google.protobuf.message import DecodeError

from common.host.servicer import ExecutorServicer
from common.wire.ownership import SESSION_METADATA
from common.wire.pb import executor_pb2 as pb
from common.wire.step_frames import (
    END,
    HEADER,
    HELLO,
    MAGIC,
    MAX_HELLO_BYTES,
    RESULT,
    STEP,
    FrameError,
    frame,
    parse_header,
)

log = logging.getLogger(__name__)


class _Ended(Exception):
    """The call ends with this gRPC status (what `context.abort` raises here)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _SocketContext:
    """What ExecutorServicer.ExecuteModel uses of a gRPC call context, for one connection."""

    def __init__(self, conn: socket.socket, peer: str, metadata: tuple):
        self._conn = conn  # the connection (its reading side is shut down by cancel)
        self._peer = peer  # "ipv4:host:port", as gRPC names peers
        self._metadata = metadata  # the hello's token and generation, as call metadata
        self.cancelled = False  # cancel() was called (another owner took the executor)

    def abort(self, code: grpc.StatusCode, details: str):
        raise _Ended(code, details)

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self) -> tuple:
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        pass

    def cancel(self) -> None:
        """End the call now: its steps stop being read, so the stream ends and the controller
        gets END CANCELLED. A controller that does not read its results any more (stopped,
        hung) has the whole connection shut down after CANCEL_GRACE seconds."""
        self.cancelled = True
        _shutdown(self._conn, socket.SHUT_RD)
        timer = threading.Timer(CANCEL_GRACE, _shutdown, (self._conn, socket.SHUT_RDWR))
        timer.daemon = True
        timer.start()


CANCEL_GRACE = 5.0  # seconds a cancelled stream has to send its END frame


def _shutdown(conn: socket.socket, how: int) -> None:
    """Shut down a connection's TCP socket; a TLS one's too, without ending its TLS object
    (ssl.SSLSocket.shutdown would drop it, and the END frame after it would go out in clear)."""
    try:
        socket.socket.shutdown(conn, how)
    except OSError:
        pass


READ_CHUNK = 1024 * 1024  # the most read into memory ahead of the bytes that arrived


def _read_exact(conn: socket.socket, n: int, deadline: float = 0.0) -> bytes | None:
    """Exactly n bytes, or None if the peer closed the connection first. Memory grows with
    the bytes that arrive (a chunk at a time), not with the length a header claims. With a
    `deadline` (time.monotonic()), TimeoutError once it passes, however the bytes trickle in."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        if deadline:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the hello timeout passed")
            conn.settimeout(left)
        part = conn.recv(min(n - got, READ_CHUNK))
        if not part:
            return None
        if len(part) == n:
            return part  # the common case: the whole frame in one read, not copied again
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class StepSocketServer:
    """Serves one servicer's ExecuteModel on `host:port` (0: any free port), a thread per
    connection."""

    def __init__(
        self,
        servicer: ExecutorServicer,
        host: str,
        port: int,
        *,
        ssl_context: ssl.SSLContext | None = None,
        token: str = "",
        max_message_bytes: int = 256 * 1024 * 1024,
        max_connections: int = 8,
        hello_timeout: float = 10.0,
    ):
        self.servicer = servicer  # runs the steps
        self.host, self.port = host, port  # where to listen (port: the bound one after start)
        self.ssl_context = ssl_context  # TLS (server side); None = plaintext
        self._token = _digest(token) if token else b""  # digest of the one accepted token
        self.max_message_bytes = max_message_bytes  # the largest step frame read
        self.max_connections = max_connections  # open connections at once; more are closed
        self.hello_timeout = hello_timeout  # seconds for the TLS handshake, magic and hello
        self._listener: socket.socket | None = None
        self._conns: set[socket.socket] = set()  # open connections
        self._lock = threading.Lock()  # guards _conns
        self.refused = 0  # connections closed before any step (over the cap, bad hello)

    def start(self) -> int:
        """Listen and accept on a daemon thread; the bound port."""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.host, self.port))
        listener.listen(16)
        self._listener, self.port = listener, listener.getsockname()[1]
        threading.Thread(target=self._accept, name="step-socket", daemon=True).start()
        return self.port

    def stop(self) -> None:
        """Stop listening and close every open connection."""
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self._lock:
            conns = list(self._conns)
        for conn in conns:
            _shutdown(conn, socket.SHUT_RDWR)

    def _accept(self) -> None:
        listener = self._listener
        while listener is not None and self._listener is listener:
            try:
                conn, addr = listener.accept()
            except OSError:
                return  # closed by stop()
            with self._lock:
                full = len(self._conns) >= self.max_connections
                if not full:
                    self._conns.add(conn)
            if full:
                self.refused += 1
                log.warning(
                    "step socket: connection from %s closed: %d open", addr, len(self._conns)
                )
                conn.close()
                continue
            name = f"step-socket-{addr[1]}"
            threading.Thread(target=self._serve, args=(conn, addr), name=name, daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = f"ipv{6 if ':' in addr[0] else 4}:{addr[0]}:{addr[1]}"
        raw = conn
        deadline = time.monotonic() + self.hello_timeout  # for the handshake and hello
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(self.hello_timeout)  # the TLS handshake's own overall deadline
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)
                with self._lock:  # the TLS socket took over the connection's descriptor
                    self._conns.discard(raw)
                    self._conns.add(conn)
            metadata = self._hello(conn, deadline)
            conn.settimeout(None)
        except (OSError, FrameError, ValueError) as exc:  # ssl.SSLError, timeouts included
            self.refused += 1
            log.warning("step socket: connection from %s refused: %s", peer, exc)
            self._close(raw, conn)
            return
        try:
            if metadata is None:
                self.refused += 1
                log.warning("step socket: connection from %s refused: wrong token", peer)
                self._send_end(conn, grpc.StatusCode.UNAUTHENTICATED, "missing or wrong token")
                return
            context = _SocketContext(conn, peer, metadata)
            for result in self.servicer.ExecuteModel(self._steps(conn), context):
                conn.sendall(frame(RESULT, result.SerializeToString()))
            if context.cancelled:
                self._send_end(conn, grpc.StatusCode.CANCELLED, "ended by the executor")
        except _Ended as exc:
            self._send_end(conn, exc.code, exc.details)
        except FrameError as exc:
            log.warning("step socket: %s sent a bad frame: %s", peer, exc)
            self._send_end(conn, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except OSError as exc:
            log.info("step socket: connection from %s broke: %s", peer, exc)
        except Exception as exc:  # as gRPC ends a call whose handler raised: UNKNOWN
            log.exception("step socket: the stream from %s failed", peer)
            self._send_end(conn, grpc.StatusCode.UNKNOWN, repr(exc))
        finally:
            self._close(raw, conn)

    def _hello(self, conn: socket.socket, deadline: float) -> tuple | None:
        """The magic and hello, read by `deadline`: the call metadata they stand for; None for
        a wrong token. FrameError (or OSError, TimeoutError) for anything else than a hello."""
        if _read_exact(conn, len(MAGIC), deadline) != MAGIC:
            raise FrameError("not a step socket client (wrong magic)")
        header = _read_exact(conn, HEADER.size, deadline)
        if header is None:
            raise FrameError("closed before its hello")
        length, _ = parse_header(header, {HELLO: MAX_HELLO_BYTES})
        payload = _read_exact(conn, length, deadline)
        if payload is None:
            raise FrameError("closed in its hello")
        try:
            hello = pb.StepSocketHello.FromString(payload)
        except DecodeError as exc:
            raise FrameError(f"a hello that does not parse: {exc}") from exc
        if self._token and not hmac.compare_digest(self._token, _digest(hello.token)):
            return None
        return ((SESSION_METADATA, str(hello.generation)),) if hello.generation else ()

    def _steps(self, conn: socket.socket) -> Iterator[pb.StepRequest]:
        """The connection's steps until the controller closes it (FrameError: not a step)."""
        kinds = {STEP: self.max_message_bytes}
        while True:
            try:
                header = _read_exact(conn, HEADER.size)
            except OSError:
                return  # shut down (cancelled, or the server stops): the stream ends
            if header is None:
                return
            length, _ = parse_header(header, kinds)
            payload = _read_exact(conn, length)
            if payload is None:
                return
            try:
                step = pb.StepRequest.FromString(payload)
            except DecodeError as exc:
                raise FrameError(f"a step that does not parse: {exc}") from exc
            yield step

    def _send_end(self, conn: socket.socket, code: grpc.StatusCode, details: str) -> None:
        end = pb.StepSocketEnd(code=code.name, details=details[:4000])
        try:
            conn.sendall(frame(END, end.SerializeToString()))
        except OSError:
            pass

    def _close(self, raw: socket.socket, conn: socket.socket) -> None:
        with self._lock:
            self._conns.discard(raw)
            self._conns.discard(conn)
        try:
            conn.close()
        finally:
            raw.close()


def server_ssl_context(cert_file: str, key_file: str, client_ca_file: str = "") -> ssl.SSLContext:
    """The step socket's TLS, as the gRPC port's (common.wire.tls.server_credentials): this
    certificate; with `client_ca_file`, client certificates that CA signed are required."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        context.verify_mode = ssl.CERT_REQUIRED
        context.load_verify_locations(client_ca_file)
    return context
