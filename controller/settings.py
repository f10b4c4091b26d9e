"""The controller's configuration (its command-line flags)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ControllerConfig:
    """How the controller serves and schedules."""

    model: str  # local Hugging Face directory: tokenizer, chat template, config
    served_model_name: str = ""  # name clients use; "" = the directory's basename
    executors: list[str] = field(default_factory=list)  # executor addresses, host:port
    host: str = "0.0.0.0"  # HTTP listen address
    port: int = 8000  # HTTP port
    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # most requests in one step
    max_model_len: int = 0  # longest sequence; 0 = the model's own
    long_prefill_token_threshold: int = 0  # cap on one request's prefill chunk; 0 = none
    # Seconds a step should take at most: an executor whose measured step cost would make a
    # full budget slower gets fewer tokens per step (chunked prefill only); 0 = the full budget.
    step_time_target: float = 0.5
    num_kv_blocks: int = 0  # override the profiled KV block count (testing); 0 = profiled
    enable_prefix_caching: bool = True  # reuse KV blocks of shared prefixes
    policy: str = "fcfs"  # scheduling policy: fcfs or priority
    scheduler_class: str = ""  # "module:Class" of a custom SchedulerBase; "" = built-in
    seed: int = 0  # executors' global seed
    step_timeout: float = 300.0  # seconds a step may take before its executor counts as lost
    pipeline_depth: int = 2  # steps in flight per executor (1 = wait for each result)
    executor_startup_timeout: float = 900.0  # seconds the handshake's cache warm-up may take
    reconnect_backoff_min: float = 0.2  # first wait between reconnect attempts
    reconnect_backoff_max: float = 10.0  # longest wait between reconnect attempts
    max_logprobs: int = 20  # most top logprobs a request may ask for
    # Discovery: executors come from `executors` (static), DNS names and files (re-read).
    executor_dns: list[str] = field(default_factory=list)  # "name:port", one address per A/AAAA
    executor_files: list[str] = field(default_factory=list)  # files of host:port lines
    dns_server: str = ""  # "host:port" of the nameserver to ask; "" = the system resolver
    discovery_interval: float = 10.0  # seconds between re-resolutions / re-reads
    # Health: gRPC health checks on every connected executor.
    health_check_interval: float = 1.0  # seconds between checks
    health_check_timeout: float = 2.0  # seconds one check may take
    health_check_failures: int = 3  # failed checks in a row that make an executor lost
    no_executor_timeout: float = 120.0  # seconds a request waits for a healthy executor (503)
    # Placement.
    prefix_affinity: bool = True  # prefer the executor holding the longest cached prefix
    affinity_max_wait: float = 2.0  # most extra seconds affinity may cost a request
    # Per device kind ("cpu", "gpu", "tpu"): (max_num_batched_tokens, max_num_seqs) overrides.
    kind_limits: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Admission: bounds on requests waiting for their first token (429 beyond them).
    max_queued_requests: int = 1024  # queued sequences across the fleet; 0 = no bound
    max_queued_tokens: int = 1 << 20  # prompt tokens of queued sequences; 0 = no bound
    retry_after: int = 1  # seconds in the Retry-After header of a 429/503
    max_request_bytes: int = 4 << 20  # largest HTTP request body (413 beyond); 0 = no bound
    # Client authentication: Bearer API keys (none = open API).
    api_keys: list[str] = field(default_factory=list)  # accepted keys (secrets)
    auth_exempt_paths: list[str] = field(default_factory=lambda: ["/health", "/metrics"])
    # Shutdown: on SIGTERM admit nothing, let responses finish this long, then abort the rest.
    shutdown_grace: float = 30.0
    # Seconds an idle HTTP keep-alive connection stays open. Longer than the idle timeout of
    # the proxies in front (60 s for nginx upstreams and cloud load balancers), so that a proxy
    # never reuses a connection the server is closing (a sporadic 502 / connection reset).
    http_keep_alive: float = 75.0
    # HTTPS for the HTTP endpoint ("" = plain HTTP).
    ssl_certfile: str = ""  # PEM certificate chain
    ssl_keyfile: str = ""  # PEM private key
    # gRPC to executors: TLS / mTLS and a shared token ("" = off).
    executor_tls_ca: str = ""  # PEM CA bundle that signs executor certificates; "" = plaintext
    executor_tls_cert: str = ""  # PEM client certificate (mTLS)
    executor_tls_key: str = ""  # PEM client key (mTLS)
    executor_tls_server_name: str = ""  # name to verify in executor certificates
    executor_token: str = ""  # sent as "authorization: Bearer <token>" on every RPC
