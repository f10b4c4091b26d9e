"""The settings every executor has: the worker's config, and how the process serves it.

Each executor kind subclasses ExecutorSettings with its own settings (executor_tpu's
TPUSettings, executor_sim's SimSettings); the settings object is the worker's config.
"""

from __future__ import annotations

from typing import Literal

from common.host.dtypes import KVCacheDtype, ModelDtype
from common.hub.settings import ModelSourceSettings
from common.settings import SettingError, derived, setting

SECURITY = "security: TLS, mTLS and a shared token"
FAILURES = "device failures"
EXIT_DEVICE_FAILED = 70  # the process's exit status after a device failure (EX_SOFTWARE)


class ExecutorConfig(ModelSourceSettings):
    """How an executor's worker runs the model (its flags; tests build one directly). The
    model and where it comes from: ModelSourceSettings."""

    served_model_name: str = setting(
        "", "name reported to the controller; '' = the model id or the directory's name"
    )
    # Precision (common/host/dtypes.py resolves "auto" against the checkpoint and device).
    dtype: ModelDtype = setting(
        "auto",
        "weights and activations dtype; auto = the checkpoint's torch_dtype on CUDA / TPU, "
        "float32 on the CPU (float16: CUDA only)",
    )
    kv_cache_dtype: KVCacheDtype = setting(
        "auto",
        "KV cache dtype; auto = --dtype's; fp8 (float8_e4m3fn) needs CUDA compute capability "
        ">= 8.9",
    )
    device: str = setting(
        "auto", "auto, cpu, cuda or cuda:N (GPU executor); auto, tpu or cpu (TPU executor)"
    )
    tensor_parallel_size: int = setting(
        1,
        "devices one executor shards the model over (GPU: one rank process per device; TPU: "
        "the chips of its host, SPMD); the controller sees one executor",
        aliases=("tensor_parallel_size", "tp"),
        ge=1,
    )
    block_size: int = setting(16, "tokens per KV block")
    kv_cache_bytes: int = setting(
        0,
        "KV budget where memory cannot be profiled (CPU); 0 = 2 GiB",
        aliases=("kv_cache_bytes", "kv_cache_memory_bytes"),
    )
    gpu_memory_utilization: float = setting(0.9, "share of device memory Tandem may use (CUDA)")
    max_num_batched_tokens: int = derived(2048, help="most tokens per step (InitDevice's)")
    max_num_seqs: int = derived(128, help="most requests per step (InitDevice's)")
    max_model_len: int = setting(0, "longest sequence; 0 = the model's own")
    seed: int = setting(0, "global seed")
    enforce_eager: bool = setting(False, "skip graph capture / compilation during warm-up")
    overlap_steps: Literal["auto", "on", "off"] = setting(
        "auto",
        "launch each step before the one in flight is finished, so the host builds its inputs "
        "while the device runs (GPU executor, one rank); auto = on CUDA; on = on the CPU too, "
        "where a step runs whole at its launch and overlapping only delays results (tests)",
    )
    chunked_prefill: bool = setting(
        True,
        "report chunked-prefill support to the controller (off: whole prompts only)",
        aliases=("chunked_prefill", "enable_chunked_prefill"),
    )
    max_logprobs: int = setting(20, "most top logprobs returned per position")
    num_threads: int = setting(0, "torch intra-op threads on CPU; 0 = torch's default")
    load_format: Literal["auto", "dummy"] = setting(
        "auto",
        "auto: the checkpoint's weights; dummy: random weights of the checkpoint's shape "
        "(config.json alone; for benchmarks)",
    )


class ExecutorSettings(ExecutorConfig):
    """An executor process: its worker's config plus how it serves (address, metrics,
    logging, security, shutdown)."""

    host: str = setting("0.0.0.0", "address to listen on")
    port: int = setting(50051, "gRPC port")
    step_port: int = setting(
        0,
        "also serve the step stream on this TCP port as framed protobuf without gRPC (same "
        "TLS and token; the controller uses it when it can reach it: less CPU per step on "
        "both sides); 0 = off",
    )
    metrics_port: int = setting(0, "serve Prometheus metrics of this process over HTTP (0 = off)")
    log_level: str = setting("INFO", "log level (DEBUG, INFO, WARNING, ERROR)")
    log_format: Literal["text", "json"] = setting("text", "log lines as text or JSON objects")
    shutdown_drain: float = setting(
        10.0,
        "after SIGTERM: seconds to report NOT_SERVING while the open step stream goes on "
        "(ends early once the controller closes it)",
    )
    tls_cert: str = setting(
        "", "PEM server certificate: serve gRPC over TLS", group=SECURITY, metavar="PATH"
    )
    tls_key: str = setting("", "PEM key of --tls-cert", group=SECURITY, metavar="PATH")
    tls_client_ca: str = setting(
        "",
        "PEM CA of client certificates: require them (mutual TLS)",
        group=SECURITY,
        metavar="PATH",
    )
    auth_token_file: str = setting(
        "",
        "file holding the token every RPC but health checks must carry",
        group=SECURITY,
        metavar="PATH",
    )
    health_port: int = setting(
        0,
        "also serve grpc.health.v1 alone, in plaintext, on this port (for probes that cannot "
        "speak TLS; 0 = off)",
        group=SECURITY,
    )
    grpc_reflection: bool = setting(
        False,
        "serve gRPC server reflection (it lists the executor's services to anyone who can "
        "reach the port; for grpcurl and debugging)",
        group=SECURITY,
    )
    # A device failure (a CUDA error, an XLA runtime failure, out of device memory) leaves the
    # device unusable: health turns NOT_SERVING at once (the controller moves the requests,
    # Kubernetes' liveness probe fails), then the process exits so that any supervisor
    # restarts it on a fresh device context.
    device_failure_exit_after: float = setting(
        5.0,
        f"after a device failure: seconds reporting NOT_SERVING before the process exits with "
        f"status {EXIT_DEVICE_FAILED} (negative = stay up, NOT_SERVING)",
        group=FAILURES,
    )
    max_failed_steps: int = setting(
        3,
        "steps in a row that fail as a whole (an error no single request explains) before the "
        "executor counts its device as failed",
        group=FAILURES,
        ge=1,
    )
    # Ownership: a controller's session holds the executor under a lease it renews; a lost
    # controller's executor waits at most this long for another controller.
    max_lease_seconds: float = setting(
        60.0,
        "longest lease a controller's session may hold the executor for (its ask is bounded "
        "to 1 s..this; below 1 counts as 1)",
        group=FAILURES,
        gt=0,
    )

    def finalize(self) -> None:
        """Reject TLS flags that do not go together."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise SettingError("tls_cert", "--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise SettingError("tls_client_ca", "--tls-client-ca needs --tls-cert and --tls-key")
