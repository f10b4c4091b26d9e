"""The controller's settings: every flag, TANDEM_* variable and config-file key it reads."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import field_validator, model_validator

from common.hub.reference import default_served_name
from common.hub.settings import ModelSourceSettings
from common.settings import SettingError, derived, setting
from common.wire.rpc_token import read_token
from controller.affinity_settings import AffinitySettings
from controller.limit_settings import LimitSettings, limit_specs

DEFAULT_EXECUTOR = "127.0.0.1:50051"  # the executor of a controller given no other
API_KEY_ENV = "TANDEM_API_KEY"  # one more accepted API key (besides --api-key, --api-key-file)
ADMIN_API_KEY_ENV = "TANDEM_ADMIN_API_KEY"  # one more admin key (besides the flags)
FLEET = "fleet: discovery, health, failover, placement"
ROBUSTNESS = "fleet robustness: what one request or executor can cost the others"
AUTH = "authentication of API clients"
ADMIN = "admin: who may read /admin/* (executor addresses and details)"
HTTP = "HTTP server: connection limits and read timeouts"
TLS = "TLS: HTTPS for clients, TLS/mTLS and a token to executors"
PEERS = "peers: other controllers, dividing the executors between the live ones"


class ControllerConfig(ModelSourceSettings, LimitSettings, AffinitySettings):
    """How the controller serves and schedules (the model and where it comes from:
    ModelSourceSettings; what clients and requests may cost: LimitSettings; which controller
    serves a request, with peers: AffinitySettings)."""

    served_model_name: str = setting(
        "", "name clients use; '' = the model id or the directory's name"
    )
    host: str = setting("0.0.0.0", "HTTP listen address")
    port: int = setting(8000, "HTTP port")
    max_num_batched_tokens: int = setting(2048, "token budget of one step")
    max_num_seqs: int = setting(128, "most requests in one step")
    max_model_len: int = setting(0, "longest sequence; 0 = the model's own")
    long_prefill_token_threshold: int = setting(0, "cap on one request's prefill chunk (0 = none)")
    # Seconds a step should take at most: an executor whose measured step cost would make a
    # full budget slower gets fewer tokens per step (chunked prefill only); 0 = the full budget.
    step_time_target: float = setting(
        0.5,
        "seconds a step should take: executors whose measured cost would make a full token "
        "budget slower get fewer tokens per step (0 = off)",
    )
    num_kv_blocks: int = setting(
        0,
        "override the profiled KV block count (0 = profiled)",
        aliases=("num_kv_blocks", "num_gpu_blocks_override"),
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse KV blocks of shared prefixes",
        aliases=("enable_prefix_caching", "prefix_caching"),
    )
    policy: Literal["fcfs", "priority"] = setting(
        "fcfs", "scheduling policy", aliases=("policy", "scheduling_policy")
    )
    scheduler_class: str = setting(
        "",
        "custom scheduler (a SchedulerBase) as module:Class; '' = built-in",
        aliases=("scheduler",),
        metavar="MODULE:CLASS",
    )
    seed: int = setting(0, "executors' global seed")
    pipeline_depth: int = setting(
        2,
        "steps in flight per executor: the next step is scheduled and sent while one runs "
        "(1 = wait for each result)",
        ge=1,
        le=4,
        metavar="N",
    )
    step_timeout: float = setting(
        300.0, "seconds a step may take before its executor counts as lost"
    )
    executor_step_socket: bool = setting(
        True,
        "send steps over the step socket an executor offers (--step-port: the same messages "
        "without gRPC's per-message cost); off = always over gRPC's ExecuteModel",
    )
    executor_startup_timeout: float = setting(
        900.0, "seconds an executor's cache warm-up (compilation) may take"
    )
    max_logprobs: int = setting(20, "most top logprobs a request may ask for")
    log_level: str = setting("INFO", "log level (DEBUG, INFO, WARNING, ERROR)")
    log_format: Literal["text", "json"] = setting("text", "log lines as text or JSON objects")
    # vLLM's name. The formats live in controller/text/tools (FORMATS); a new one is added
    # there and here.
    tool_call_parser: Literal["auto", "smollm2", "hermes"] = setting(
        "auto",
        "how tools are shown to the model and its tool calls read and constrained: auto "
        "(hermes when the chat template writes <tool_call> blocks, else smollm2), smollm2, hermes",
    )
    # Seconds an idle HTTP keep-alive connection stays open. Longer than the idle timeout of
    # the proxies in front (60 s for nginx upstreams and cloud load balancers), so that a proxy
    # never reuses a connection the server is closing (a sporadic 502 / connection reset).
    http_keep_alive: float = setting(
        75.0,
        "seconds an idle HTTP keep-alive connection stays open (keep it above the idle "
        "timeout of any proxy in front)",
        group=HTTP,
    )
    # Half-open and slow connections: each holds a socket (a file descriptor) and memory, so
    # their number and the time a client may take to send a request are bounded.
    http_max_connections: int = setting(
        2048,
        "most open HTTP connections; more are answered 503 and closed at once (0 = no bound; "
        "held below the process's file limit)",
        group=HTTP,
        ge=0,
    )
    http_max_header_bytes: int = setting(
        64 * 1024,
        "largest request line plus headers; larger ones get 431 (0 = no bound)",
        group=HTTP,
        ge=0,
    )
    http_header_timeout: float = setting(
        20.0,
        "seconds a client may take to send its request line and headers, from the connection "
        "(or its next request's first byte); then 408 and close (0 = none)",
        group=HTTP,
        ge=0,
    )
    http_body_timeout: float = setting(
        60.0,
        "seconds a request's whole body may take to arrive after its headers; then 408 and "
        "close (0 = none)",
        group=HTTP,
        ge=0,
    )
    # Streamed responses' chunks can be detokenized, formatted and written by processes of
    # their own, so that the socket writes and the per-token text leave the scheduling core.
    stream_writers: int = setting(
        0,
        "stream writer processes that write streamed responses to plain-TCP clients (0 = the "
        "controller's own process writes them; docs/design/stream_writers.md)",
        group=HTTP,
        ge=0,
        le=64,
    )
    # Shutdown: on SIGTERM admit nothing, let responses finish this long, then abort the rest.
    shutdown_grace: float = setting(
        30.0,
        "seconds open responses may finish after SIGTERM before they are aborted",
        aliases=("shutdown_grace", "shutdown_timeout"),
    )

    # Discovery: executors come from `executors` (static), DNS names and files (re-read).
    executors: list[str] = setting(
        [], "executor address (repeatable)", aliases=("executor",), group=FLEET, metavar="HOST:PORT"
    )
    executor_dns: list[str] = setting(
        [],
        "DNS name whose every A/AAAA record is an executor (e.g. a Kubernetes headless "
        "Service); re-resolved (repeatable)",
        group=FLEET,
        metavar="NAME:PORT",
    )
    executor_files: list[str] = setting(
        [],
        "file of host:port lines, re-read (repeatable)",
        aliases=("executor_file",),
        group=FLEET,
        metavar="PATH",
    )
    dns_server: str = setting(
        "",
        "nameserver for --executor-dns; '' = the system resolver",
        group=FLEET,
        metavar="HOST:PORT",
    )
    discovery_interval: float = setting(
        10.0, "seconds between re-resolutions of DNS names and files", group=FLEET
    )
    # Health: gRPC health checks on every connected executor.
    health_check_interval: float = setting(1.0, "seconds between health checks", group=FLEET)
    health_check_timeout: float = setting(2.0, "seconds one health check may take", group=FLEET)
    health_check_failures: int = setting(
        3, "failed health checks in a row that make an executor lost", group=FLEET
    )
    reconnect_backoff_min: float = derived(0.2, help="first wait between reconnect attempts")
    reconnect_backoff_max: float = setting(
        10.0, "longest wait between reconnect attempts", group=FLEET
    )
    # Ownership: an executor serves one controller at a time, under a lease the controller
    # renews every third of it; a controller that is gone loses its executors after this long.
    executor_lease_seconds: float = setting(
        10.0,
        "lease on each executor this controller drives (renewed every third of it); another "
        "controller may take an executor whose owner is gone once it expires",
        group=FLEET,
        gt=0,
    )
    # Peers: the other controllers of the fleet; the live ones divide the executors between
    # them (controller/fleet/division.py). None configured: this controller drives them all.
    peers: list[str] = setting(
        [],
        "another controller's HTTP address, probed at GET /peer (repeatable; this "
        "controller's own address may be listed too)",
        aliases=("peer",),
        group=PEERS,
        metavar="HOST:PORT",
    )
    peer_dns: list[str] = setting(
        [],
        "DNS name whose every A/AAAA record is a controller (a headless Service that "
        "publishes not-ready addresses); re-resolved (repeatable)",
        group=PEERS,
        metavar="NAME:PORT",
    )
    peer_files: list[str] = setting(
        [],
        "file of controllers' host:port lines, re-read (repeatable)",
        aliases=("peer_file",),
        group=PEERS,
        metavar="PATH",
    )
    advertise_address: str = setting(
        "",
        "this controller's name in the division of executors, as its peers learn it from "
        "/peer; '' = --host:--port (the host name when --host is a wildcard)",
        group=PEERS,
        metavar="HOST:PORT",
    )
    peer_probe_interval: float = setting(
        1.0,
        "seconds between probes of each peer; a peer is live while it answered within the "
        "last 3 probe periods",
        group=PEERS,
        gt=0,
    )
    handover_drain_timeout: float = setting(
        30.0,
        "seconds an executor that the division gave another controller may finish its "
        "requests before the rest move (failover) and it is released",
        group=PEERS,
        ge=0,
    )
    no_executor_timeout: float = setting(
        120.0, "seconds a request waits for a healthy executor before a 503", group=FLEET
    )
    # Fleet robustness: a request whose executor keeps failing under it may be what takes the
    # executors down; past this many moves it fails alone instead of taking the next one.
    max_request_moves: int = setting(
        3,
        "times a request is moved off a lost executor; lost once more, it fails "
        "(an error to its client) instead of moving again",
        group=ROBUSTNESS,
        ge=0,
    )
    # Placement.
    prefix_affinity: bool = setting(
        True,
        "prefer the executor holding the longest cached prefix (off: place by estimated time only)",
        group=FLEET,
    )
    affinity_max_wait: float = setting(
        2.0, "most extra seconds prefix affinity may cost a request", group=FLEET
    )
    executor_limits: list[str] = setting(
        [],
        "per device kind step limits, e.g. tpu=64,8 (repeatable; SEQS defaults to --max-num-seqs)",
        group=FLEET,
        metavar="KIND=TOKENS[,SEQS]",
    )
    # Per device kind ("cpu", "gpu", "tpu"): (max_num_batched_tokens, max_num_seqs) overrides.
    kind_limits: dict[str, tuple[int, int]] = derived(default_factory=dict)

    # Client authentication: Bearer API keys (none = open API).
    api_keys: list[str] = setting(
        [],
        "accepted Bearer key (repeatable; $TANDEM_API_KEY adds one more)",
        aliases=("api_key",),
        group=AUTH,
        metavar="KEY",
        env=False,  # TANDEM_API_KEY holds one key, added to the others (load_api_keys)
    )
    api_key_files: list[str] = setting(
        [],
        "file of accepted keys, one per line (repeatable)",
        aliases=("api_key_file",),
        group=AUTH,
        metavar="PATH",
    )
    auth_exempt_paths: list[str] = setting(
        ["/health", "/metrics"],
        "path served without a key (repeatable; replaces the default)",
        aliases=("auth_exempt_path",),
        group=AUTH,
        metavar="PATH",
    )

    # Admin routes (/admin/*: executor addresses, fleet and admission details): their own keys,
    # never the API keys; without one, only clients on this host (loopback) reach them.
    admin_api_keys: list[str] = setting(
        [],
        "admin Bearer key for /admin/* (repeatable; $TANDEM_ADMIN_API_KEY adds one more; "
        "none = /admin/* answers direct loopback clients only)",
        aliases=("admin_api_key",),
        group=ADMIN,
        metavar="KEY",
        env=False,  # TANDEM_ADMIN_API_KEY holds one key, added to the others (load_api_keys)
    )
    admin_api_key_files: list[str] = setting(
        [],
        "file of admin keys, one per line (repeatable)",
        aliases=("admin_api_key_file",),
        group=ADMIN,
        metavar="PATH",
    )

    # HTTPS for the HTTP endpoint ("" = plain HTTP).
    ssl_certfile: str = setting("", "PEM certificate chain: serve HTTPS", group=TLS, metavar="PATH")
    ssl_keyfile: str = setting("", "PEM key of --ssl-certfile", group=TLS, metavar="PATH")
    # gRPC to executors: TLS / mTLS and a shared token ("" = off).
    executor_tls_ca: str = setting(
        "", "PEM CA that signs executor certificates: gRPC over TLS", group=TLS, metavar="PATH"
    )
    executor_tls_cert: str = setting(
        "", "PEM client certificate for executors that require mTLS", group=TLS, metavar="PATH"
    )
    executor_tls_key: str = setting("", "PEM key of --executor-tls-cert", group=TLS, metavar="PATH")
    executor_tls_server_name: str = setting(
        "", "name to verify in executor certificates; '' = the host", group=TLS
    )
    auth_token_file: str = setting(
        "", "file holding the token sent to executors on every RPC", group=TLS, metavar="PATH"
    )
    executor_token: str = derived("")  # sent as "authorization: Bearer <token>" on every RPC

    @field_validator("executor_limits")
    @classmethod
    def _check_limits(cls, values: list[str]) -> list[str]:
        return limit_specs(values)

    @model_validator(mode="after")
    def _derive_kind_limits(self) -> ControllerConfig:
        for spec in self.executor_limits:
            kind, _, numbers = spec.partition("=")
            tokens, _, seqs = numbers.partition(",")
            self.kind_limits[kind] = (int(tokens), int(seqs) if seqs else self.max_num_seqs)
        return self

    def finalize(self) -> None:
        """The served name, the default executor, the advertised address, the API and admin
        keys and the executor token."""
        if not self.served_model_name:
            self.served_model_name = default_served_name(self.model)
        if not (self.executors or self.executor_dns or self.executor_files):
            self.executors = [DEFAULT_EXECUTOR]
        if not self.advertise_address:
            host = socket.gethostname() if self.host in ("", "0.0.0.0", "::") else self.host
            self.advertise_address = (
                f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"
            )
        try:
            self.api_keys = load_api_keys(self.api_keys, self.api_key_files)
        except OSError as e:
            raise SettingError("api_key_files", str(e)) from None
        try:
            self.admin_api_keys = load_api_keys(
                self.admin_api_keys, self.admin_api_key_files, variable=ADMIN_API_KEY_ENV
            )
        except OSError as e:
            raise SettingError("admin_api_key_files", str(e)) from None
        if set(self.admin_api_keys) & set(self.api_keys):
            raise SettingError("admin_api_keys", "an admin key may not also be an API key")
        if self.auth_token_file:
            try:
                self.executor_token = read_token(self.auth_token_file)
            except (OSError, ValueError) as e:
                raise SettingError("auth_token_file", str(e)) from None


def load_api_keys(
    keys: list[str], files: list[str], environ=os.environ, variable: str = API_KEY_ENV
) -> list[str]:
    """Every configured key: the given ones, each file's lines (# comments skipped), and
    the environment `variable` ($TANDEM_API_KEY: one key, added to the others)."""
    found = [k.strip() for k in keys if k.strip()]
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line and not line.startswith("#"):
                    found.append(line)
    env = environ.get(variable, "").strip()
    if env:
        found.append(env)
    return list(dict.fromkeys(found))
