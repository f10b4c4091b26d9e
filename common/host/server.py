"""The gRPC server bootstrap shared by every executor kind (their settings: settings.py)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import logs
from common.host.dtypes import DtypeError
from common.host.lease import SessionLease
from common.host.servicer import ExecutorServicer
from common.host.settings import EXIT_DEVICE_FAILED, ExecutorConfig, ExecutorSettings
from common.host.step_socket import StepSocketServer, server_ssl_context
from common.host.worker_base import WorkerBase
from common.hub.files import EXECUTOR, Need
from common.hub.resolve import localize_or_exit
from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.rpc_token import TokenInterceptor, read_token
from common.wire.tls import server_credentials

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a step of long prompts can be large


def start_metrics_server(host: str, port: int) -> None:
    """Serve the process's default Prometheus registry at http://host:port/metrics."""
    from common.host.metrics import serve_metrics

    serve_metrics(host, port)
    log.info("Prometheus metrics on %s:%d", host, port)


def _health_only_server(health_servicer, host: str, port: int) -> grpc.Server:
    """A plaintext server of grpc.health.v1 alone (probes that cannot speak TLS)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server


@dataclass
class ExecutorServer:
    """One worker served over gRPC: the Executor service, health (and reflection, opt-in)."""

    server: grpc.Server  # the started gRPC server
    health: health.HealthServicer  # grpc.health.v1 state (NOT_SERVING until loaded)
    servicer: ExecutorServicer  # the Executor service over the worker
    port: int  # the bound port (the one asked for, or the one chosen for port 0)
    # Set when the process should end: a device failure, once its NOT_SERVING time is over.
    device_failed: threading.Event
    step_socket: StepSocketServer | None = None  # the steps' own port (--step-port), if any


def _report_device_failure(
    health_servicer: health.HealthServicer, exit_after: float, failed: threading.Event
) -> Callable[[str], None]:
    """What a device failure does to the server: NOT_SERVING at once (the controller stops
    sending work, a liveness probe fails), then, unless ``exit_after`` is negative, the
    process is told to end after ``exit_after`` seconds (``failed`` is set)."""

    def report(reason: str) -> None:
        for name in ("", SERVICE_NAME):
            health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        if exit_after >= 0:
            timer = threading.Timer(exit_after, failed.set)
            timer.daemon = True
            timer.start()

    return report


def start_server(
    worker: WorkerBase, settings: ExecutorSettings, port: int, step_port: int = -1
) -> ExecutorServer:
    """Serve ``worker`` on ``settings.host:port`` (0: any free port) with the security the
    settings ask for; health reports NOT_SERVING until ``mark_serving`` (and again after a
    device failure). ``step_port``: the step socket's port (-1: ``settings.step_port``;
    0: none)."""
    token_file = settings.auth_token_file
    interceptors = [TokenInterceptor(read_token(token_file))] if token_file else []
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=8),
        interceptors=interceptors,
        options=[
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ],
    )
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    failed = threading.Event()
    servicer = ExecutorServicer(
        worker,
        settings.max_failed_steps,
        _report_device_failure(health_servicer, settings.device_failure_exit_after, failed),
        SessionLease(settings.max_lease_seconds),
    )
    pb_grpc.add_ExecutorServicer_to_server(servicer, server)
    if settings.grpc_reflection:  # opt-in: it tells anyone who can connect what is served
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
        )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{settings.host}:{port}"
    if settings.tls_cert:
        creds = server_credentials(settings.tls_cert, settings.tls_key, settings.tls_client_ca)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    server.start()
    security = "mTLS" if settings.tls_client_ca else "TLS" if settings.tls_cert else "plaintext"
    log.info(
        "listening on %s:%d (%s%s%s)",
        settings.host,
        bound,
        security,
        ", token" if interceptors else "",
        ", reflection" if settings.grpc_reflection else "",
    )
    step_port = settings.step_port if step_port < 0 else step_port
    sockets = None
    if step_port:
        sockets = StepSocketServer(
            servicer,
            settings.host,
            step_port,
            ssl_context=server_ssl_context(
                settings.tls_cert, settings.tls_key, settings.tls_client_ca
            )
            if settings.tls_cert
            else None,
            token=read_token(token_file) if token_file else "",
            max_message_bytes=MAX_MESSAGE_BYTES,
        )
        servicer.step_socket_port = sockets.start()
        log.info("steps also on %s:%d (%s)", settings.host, sockets.port, security)
    return ExecutorServer(server, health_servicer, servicer, bound, failed, sockets)


def mark_serving(served: ExecutorServer) -> None:
    """Report SERVING (the worker is loaded)."""
    for name in ("", SERVICE_NAME):
        served.health.set(name, health_pb2.HealthCheckResponse.SERVING)


def wait_for_signal(stop: threading.Event | None = None) -> None:
    """Block until SIGTERM or SIGINT (or until ``stop`` is set)."""
    stop = stop or threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()


def shut_down(servers: list[ExecutorServer], drain: float) -> None:
    """Report NOT_SERVING, let open step streams go on for up to ``drain`` seconds (ending
    early once their controllers close them), then stop the servers."""
    drain = max(drain, 0.0)
    log.info(
        "shutting down: NOT_SERVING; draining %d step streams for up to %.0fs",
        sum(s.servicer.streams_open for s in servers),
        drain,
    )
    for s in servers:
        s.health.enter_graceful_shutdown()
    deadline = time.monotonic() + drain
    for s in servers:
        if not s.servicer.wait_streams_closed(max(deadline - time.monotonic(), 0.0)):
            log.warning("a step stream is still open after %.0fs; stopping anyway", drain)
    for s in servers:
        if s.step_socket is not None:
            s.step_socket.stop()
    for stopped in [s.server.stop(grace=5) for s in servers]:  # in parallel, 5 s at most
        stopped.wait()


def configure_logging(settings: ExecutorSettings) -> None:
    """Log to stderr at ``--log-level`` in ``--log-format``."""
    logs.configure_logging(settings.log_level, settings.log_format, service="executor")


def prepare_model(
    settings: ExecutorSettings, prog: str, need: Need | None = None
) -> ExecutorSettings:
    """Configure logging, then make the model local (a Hub id: fetched into the Hub cache)
    before anything heavy loads: a model that cannot be served ends the process at once, in
    one line. ``need``: what the executor reads (default: config and weights, or the config
    alone with --load-format dummy)."""
    configure_logging(settings)
    if need is None:
        need = EXECUTOR if settings.load_format == "auto" else Need.CONFIG
    return localize_or_exit(settings, need, prog)


def serve(
    worker_factory: Callable[[ExecutorConfig], WorkerBase], settings: ExecutorSettings
) -> None:
    """Load the model, then serve Executor and health (reflection if asked) until SIGTERM /
    SIGINT, or until a device failure's NOT_SERVING time is over: then the process exits with
    status EXIT_DEVICE_FAILED. The settings are the worker's config too."""
    configure_logging(settings)
    worker = worker_factory(settings)
    if settings.metrics_port:
        start_metrics_server(settings.host, settings.metrics_port)
    served = start_server(worker, settings, settings.port)
    health_server = None
    if settings.health_port:
        health_server = _health_only_server(served.health, settings.host, settings.health_port)
    log.info("loading %s", settings.model)
    try:
        served.servicer.load()
    except DtypeError as exc:  # a dtype this device cannot run: a usage error, said plainly
        log.critical("%s", exc)
        served.server.stop(grace=0)
        sys.exit(2)
    mark_serving(served)
    log.info("ready: %s on %s", worker.device_kind, worker.device_name)
    wait_for_signal(served.device_failed)
    failure = served.servicer.device_failure
    shut_down([served], 0.0 if failure else settings.shutdown_drain)
    if health_server is not None:
        health_server.stop(grace=1).wait()
    if failure:
        log.critical("exiting after a device failure: %s", failure)
        sys.exit(EXIT_DEVICE_FAILED)
