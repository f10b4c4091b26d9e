"""Command line and gRPC server bootstrap shared by every executor kind."""

from __future__ import annotations

import argparse
import logging
import signal
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from common import logs
from common.host.servicer import ExecutorServicer
from common.host.worker_base import WorkerBase
from common.wire.config import ExecutorConfig
from common.wire.pb import executor_pb2 as pb
from common.wire.pb import executor_pb2_grpc as pb_grpc
from common.wire.rpc_token import TokenInterceptor, read_token
from common.wire.tls import server_credentials

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Executor"].full_name
MAX_MESSAGE_BYTES = 256 * 1024 * 1024  # a step of long prompts can be large


def build_arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """Flags common to every executor."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", default="", help="name reported to the controller")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=50051, help="gRPC port")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument(
        "--device",
        default="auto",
        help="auto, cpu, cuda or cuda:N (GPU executor); auto, tpu or cpu (TPU)",
    )
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=0,
        help="KV budget where memory cannot be profiled (CPU); 0 = 2 GiB",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's own")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--enforce-eager", action="store_true", help="no graph capture / compile")
    p.add_argument(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights of the checkpoint's shape (config.json alone; for benchmarks)",
    )
    p.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="report no chunked-prefill support (whole prompts only)",
    )
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--num-threads", type=int, default=0, help="CPU threads; 0 = default")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="serve Prometheus metrics of this process over HTTP (0 = off)",
    )
    p.add_argument("--log-level", default="INFO")
    sec = p.add_argument_group("security: TLS, mTLS and a shared token")
    sec.add_argument("--tls-cert", default="", help="PEM server certificate: serve gRPC over TLS")
    sec.add_argument("--tls-key", default="", help="PEM key of --tls-cert")
    sec.add_argument(
        "--tls-client-ca",
        default="",
        help="PEM CA of client certificates: require them (mutual TLS)",
    )
    sec.add_argument(
        "--auth-token-file",
        default="",
        help="file holding the token every RPC but health checks must carry",
    )
    sec.add_argument(
        "--health-port",
        type=int,
        default=0,
        help="also serve grpc.health.v1 alone, in plaintext, on this port (for "
        "probes that cannot speak TLS; 0 = off)",
    )
    p.add_argument(
        "--shutdown-drain",
        type=float,
        default=10.0,
        help="after SIGTERM: seconds to report NOT_SERVING while the open step "
        "stream goes on (ends early once the controller closes it)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> ExecutorConfig:
    """The ExecutorConfig the flags describe."""
    return ExecutorConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        block_size=args.block_size,
        kv_cache_bytes=args.kv_cache_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.max_model_len,
        seed=args.seed,
        enforce_eager=args.enforce_eager,
        chunked_prefill=not args.no_chunked_prefill,
        max_logprobs=args.max_logprobs,
        num_threads=args.num_threads,
        load_format=args.load_format,
    )


def start_metrics_server(host: str, port: int) -> None:
    """Serve the process's default Prometheus registry at http://host:port/metrics."""
    from common.host.metrics import serve_metrics

    serve_metrics(host, port)
    log.info("Prometheus metrics on %s:%d", host, port)


def check_security_args(args) -> None:
    """Exit with a message when the TLS flags do not go together."""
    if bool(getattr(args, "tls_cert", "")) != bool(getattr(args, "tls_key", "")):
        raise SystemExit("--tls-cert and --tls-key go together")
    if getattr(args, "tls_client_ca", "") and not getattr(args, "tls_cert", ""):
        raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key")


def _health_only_server(health_servicer, host: str, port: int) -> grpc.Server:
    """A plaintext server of grpc.health.v1 alone (probes that cannot speak TLS)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server


@dataclass
class ExecutorServer:
    """One worker served over gRPC: the Executor service, health and reflection."""

    server: grpc.Server  # the started gRPC server
    health: health.HealthServicer  # grpc.health.v1 state (NOT_SERVING until loaded)
    servicer: ExecutorServicer  # the Executor service over the worker
    port: int  # the bound port (the one asked for, or the one chosen for port 0)


def start_server(worker: WorkerBase, args, port: int) -> ExecutorServer:
    """Serve ``worker`` on ``args.host:port`` (0: any free port) with the security the flags
    ask for; health reports NOT_SERVING until ``mark_serving``."""
    token_file = getattr(args, "auth_token_file", "")
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
    servicer = ExecutorServicer(worker)
    pb_grpc.add_ExecutorServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server
    )
    for name in ("", SERVICE_NAME):
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    address = f"{args.host}:{port}"
    if getattr(args, "tls_cert", ""):
        creds = server_credentials(args.tls_cert, args.tls_key, args.tls_client_ca)
        bound = server.add_secure_port(address, creds)
    else:
        bound = server.add_insecure_port(address)
    server.start()
    log.info(
        "listening on %s:%d (%s%s)",
        args.host,
        bound,
        "mTLS"
        if getattr(args, "tls_client_ca", "")
        else "TLS"
        if getattr(args, "tls_cert", "")
        else "plaintext",
        ", token" if interceptors else "",
    )
    return ExecutorServer(server, health_servicer, servicer, bound)


def mark_serving(served: ExecutorServer) -> None:
    """Report SERVING (the worker is loaded)."""
    for name in ("", SERVICE_NAME):
        served.health.set(name, health_pb2.HealthCheckResponse.SERVING)


def wait_for_signal() -> None:
    """Block until SIGTERM or SIGINT."""
    stop = threading.Event()
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
    for stopped in [s.server.stop(grace=5) for s in servers]:  # in parallel, 5 s at most
        stopped.wait()


def configure_logging(args) -> None:
    """Log to stderr at ``--log-level``."""
    logs.configure_logging(args.log_level, service="executor")


def serve(worker_factory: Callable[[ExecutorConfig], WorkerBase], args) -> None:
    """Load the model, then serve Executor, health and reflection until SIGTERM/SIGINT."""
    configure_logging(args)
    check_security_args(args)
    worker = worker_factory(config_from_args(args))
    if getattr(args, "metrics_port", 0):
        start_metrics_server(args.host, args.metrics_port)
    served = start_server(worker, args, args.port)
    health_server = None
    if getattr(args, "health_port", 0):
        health_server = _health_only_server(served.health, args.host, args.health_port)
    log.info("loading %s", args.model)
    served.servicer.load()
    mark_serving(served)
    log.info("ready: %s on %s", worker.device_kind, worker.device_name)
    wait_for_signal()
    shut_down([served], getattr(args, "shutdown_drain", 0.0))
    if health_server is not None:
        health_server.stop(grace=1).wait()
