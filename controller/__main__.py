"""`python -m controller`: the OpenAI-compatible endpoint in front of executors."""

from __future__ import annotations

import argparse
import gc
import os

import uvicorn

from common.logs import configure_logging
from common.wire.rpc_token import read_token
from controller.api.admission import Admission, AdmissionLimits
from controller.api.auth import DEFAULT_EXEMPT_PATHS, load_api_keys
from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.api.shutdown import GracefulServer
from controller.fleet.engine import Engine
from controller.settings import ControllerConfig
from controller.text.tokenizer import Tokenizer


def parse_args(argv=None) -> ControllerConfig:
    p = argparse.ArgumentParser(
        prog="python -m controller",
        description="Tandem controller: OpenAI API, scheduling and KV allocation for executors.",
    )
    p.add_argument("--model", required=True, help="local Hugging Face model directory")
    p.add_argument("--served-model-name", default="", help="name clients use (default: dir name)")
    p.add_argument(
        "--executor",
        action="append",
        default=[],
        dest="executors",
        help="executor address host:port (repeatable)",
    )
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget/step")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests per step")
    p.add_argument("--max-model-len", type=int, default=0, help="0 = the model's own")
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="cap one request's prefill chunk (0 = none)",
    )
    p.add_argument(
        "--step-time-target",
        type=float,
        default=0.5,
        help="seconds a step should take: executors whose measured cost would make "
        "a full token budget slower get fewer tokens per step (0 = off)",
    )
    p.add_argument(
        "--num-kv-blocks",
        type=int,
        default=0,
        help="override the profiled KV block count (0 = profiled)",
    )
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--scheduler", default="", help="custom scheduler as module:Class")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--pipeline-depth",
        type=int,
        default=2,
        choices=range(1, 5),
        metavar="N",
        help="steps in flight per executor: the next step is "
        "scheduled and sent while one runs (1 = wait for each result)",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=300.0,
        help="seconds a step may take before its executor counts as lost",
    )
    p.add_argument(
        "--executor-startup-timeout",
        type=float,
        default=900.0,
        help="seconds an executor's cache warm-up (compilation) may take",
    )
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--log-level", default="INFO")
    fleet = p.add_argument_group("fleet: discovery, health, failover, placement")
    fleet.add_argument(
        "--executor-dns",
        action="append",
        default=[],
        metavar="NAME:PORT",
        help="DNS name whose every A/AAAA record is an executor (e.g. a "
        "Kubernetes headless Service); re-resolved (repeatable)",
    )
    fleet.add_argument(
        "--executor-file",
        action="append",
        default=[],
        metavar="PATH",
        help="file of host:port lines, re-read (repeatable)",
    )
    fleet.add_argument(
        "--dns-server",
        default="",
        metavar="HOST:PORT",
        help="nameserver for --executor-dns (default: the system resolver)",
    )
    fleet.add_argument(
        "--discovery-interval",
        type=float,
        default=10.0,
        help="seconds between re-resolutions of DNS names and files",
    )
    fleet.add_argument("--health-check-interval", type=float, default=1.0)
    fleet.add_argument("--health-check-timeout", type=float, default=2.0)
    fleet.add_argument(
        "--health-check-failures",
        type=int,
        default=3,
        help="failed health checks in a row that make an executor lost",
    )
    fleet.add_argument(
        "--reconnect-backoff-max",
        type=float,
        default=10.0,
        help="longest wait between reconnect attempts",
    )
    fleet.add_argument(
        "--no-executor-timeout",
        type=float,
        default=120.0,
        help="seconds a request waits for a healthy executor before a 503",
    )
    fleet.add_argument(
        "--no-prefix-affinity",
        action="store_true",
        help="place by estimated time only, ignoring cached prefixes",
    )
    fleet.add_argument(
        "--affinity-max-wait",
        type=float,
        default=2.0,
        help="most extra seconds prefix affinity may cost a request",
    )
    fleet.add_argument(
        "--executor-limits",
        action="append",
        default=[],
        metavar="KIND=TOKENS,SEQS",
        help="per device kind step limits, e.g. tpu=64,8 (repeatable)",
    )
    _add_operations_flags(p)
    a = p.parse_args(argv)
    kind_limits = {}
    for spec in a.executor_limits:
        kind, _, values = spec.partition("=")
        tokens, _, seqs = values.partition(",")
        if not kind or not tokens.isdigit() or (seqs and not seqs.isdigit()):
            p.error(f"--executor-limits {spec!r}: expected KIND=TOKENS[,SEQS]")
        kind_limits[kind] = (int(tokens), int(seqs) if seqs else a.max_num_seqs)
    configure_logging(a.log_level, service="controller")
    return ControllerConfig(
        model=a.model,
        served_model_name=a.served_model_name or os.path.basename(os.path.normpath(a.model)),
        executors=a.executors or ([] if a.executor_dns or a.executor_file else ["127.0.0.1:50051"]),
        host=a.host,
        port=a.port,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        max_model_len=a.max_model_len,
        long_prefill_token_threshold=a.long_prefill_token_threshold,
        step_time_target=a.step_time_target,
        num_kv_blocks=a.num_kv_blocks,
        enable_prefix_caching=not a.no_prefix_caching,
        policy=a.policy,
        scheduler_class=a.scheduler,
        seed=a.seed,
        step_timeout=a.step_timeout,
        pipeline_depth=a.pipeline_depth,
        executor_startup_timeout=a.executor_startup_timeout,
        max_logprobs=a.max_logprobs,
        executor_dns=a.executor_dns,
        executor_files=a.executor_file,
        dns_server=a.dns_server,
        discovery_interval=a.discovery_interval,
        health_check_interval=a.health_check_interval,
        health_check_timeout=a.health_check_timeout,
        health_check_failures=a.health_check_failures,
        reconnect_backoff_max=a.reconnect_backoff_max,
        no_executor_timeout=a.no_executor_timeout,
        prefix_affinity=not a.no_prefix_affinity,
        affinity_max_wait=a.affinity_max_wait,
        kind_limits=kind_limits,
        max_queued_requests=a.max_queued_requests,
        max_queued_tokens=a.max_queued_tokens,
        retry_after=a.retry_after,
        max_request_bytes=a.max_request_bytes,
        api_keys=load_api_keys(a.api_keys, a.api_key_files),
        auth_exempt_paths=a.auth_exempt_paths or list(DEFAULT_EXEMPT_PATHS),
        shutdown_grace=a.shutdown_grace,
        http_keep_alive=a.http_keep_alive,
        ssl_certfile=a.ssl_certfile,
        ssl_keyfile=a.ssl_keyfile,
        executor_tls_ca=a.executor_tls_ca,
        executor_tls_cert=a.executor_tls_cert,
        executor_tls_key=a.executor_tls_key,
        executor_tls_server_name=a.executor_tls_server_name,
        executor_token=read_token(a.auth_token_file) if a.auth_token_file else "",
    )


def _add_operations_flags(p: argparse.ArgumentParser) -> None:
    """Flags for limits, authentication, TLS and shutdown."""
    lim = p.add_argument_group("limits: admission control and request size")
    lim.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="sequences waiting for their first token, fleet-wide, before new "
        "requests get 429 (0 = no bound)",
    )
    lim.add_argument(
        "--max-queued-tokens",
        type=int,
        default=1 << 20,
        help="prompt tokens of those sequences before 429 (0 = no bound)",
    )
    lim.add_argument(
        "--retry-after",
        type=int,
        default=1,
        help="seconds in the Retry-After header of a 429 or a shutdown 503",
    )
    lim.add_argument(
        "--max-request-bytes",
        type=int,
        default=4 << 20,
        help="largest HTTP request body; larger ones get 413 (0 = no bound)",
    )
    auth = p.add_argument_group("authentication of API clients")
    auth.add_argument(
        "--api-key",
        action="append",
        default=[],
        dest="api_keys",
        help="accepted Bearer key (repeatable; also $TANDEM_API_KEY)",
    )
    auth.add_argument(
        "--api-key-file",
        action="append",
        default=[],
        dest="api_key_files",
        help="file of accepted keys, one per line (repeatable)",
    )
    auth.add_argument(
        "--auth-exempt-path",
        action="append",
        default=[],
        dest="auth_exempt_paths",
        help="path served without a key (repeatable; default: "
        + ", ".join(DEFAULT_EXEMPT_PATHS)
        + ")",
    )
    tls = p.add_argument_group("TLS: HTTPS for clients, TLS/mTLS and a token to executors")
    tls.add_argument("--ssl-certfile", default="", help="PEM certificate: serve HTTPS")
    tls.add_argument("--ssl-keyfile", default="", help="PEM key of --ssl-certfile")
    tls.add_argument(
        "--executor-tls-ca",
        default="",
        help="PEM CA that signs executor certificates: gRPC over TLS",
    )
    tls.add_argument(
        "--executor-tls-cert",
        default="",
        help="PEM client certificate for executors that require mTLS",
    )
    tls.add_argument("--executor-tls-key", default="", help="PEM key of --executor-tls-cert")
    tls.add_argument(
        "--executor-tls-server-name",
        default="",
        help="name to verify in executor certificates (default: the host)",
    )
    tls.add_argument(
        "--auth-token-file",
        default="",
        help="file holding the token sent to executors on every RPC",
    )
    p.add_argument(
        "--http-keep-alive",
        type=float,
        default=75.0,
        help="seconds an idle HTTP keep-alive connection stays open (keep it above "
        "the idle timeout of any proxy in front)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=30.0,
        help="seconds open responses may finish after SIGTERM before they are aborted",
    )


def tune_gc() -> None:
    """Keep Python's cycle collector off the step loop's back: the objects of startup (the
    tokenizer, the app) are frozen out of its scans, and young-generation passes run every
    50,000 allocations instead of 700. A step allocates a handful of objects per request, so
    at 256 requests the default thresholds ran a collection several times per step and a
    full one every few hundred steps, each scanning every live request's state."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def main(argv=None) -> None:
    config = parse_args(argv)
    tokenizer = Tokenizer.from_model_dir(config.model)
    engine = Engine(config, tokenizer)
    admission = Admission(
        AdmissionLimits(config.max_queued_requests, config.max_queued_tokens, config.retry_after)
    )
    serving = OpenAIServing(
        engine, tokenizer, config.served_model_name, config.max_logprobs, admission
    )
    app = create_app(engine, serving)
    tune_gc()
    server = GracefulServer(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level="warning",
            timeout_graceful_shutdown=10,
            timeout_keep_alive=config.http_keep_alive,
            ssl_certfile=config.ssl_certfile or None,
            ssl_keyfile=config.ssl_keyfile or None,
        ),
        admission,
        config.shutdown_grace,
    )
    server.run()


if __name__ == "__main__":
    main()
