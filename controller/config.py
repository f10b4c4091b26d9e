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
    num_kv_blocks: int = 0  # override the profiled KV block count (testing); 0 = profiled
    enable_prefix_caching: bool = True  # reuse KV blocks of shared prefixes
    policy: str = "fcfs"  # scheduling policy: fcfs or priority
    scheduler_class: str = ""  # "module:Class" of a custom SchedulerBase; "" = built-in
    seed: int = 0  # executors' global seed
    step_timeout: float = 300.0  # seconds a step may take before its executor counts as lost
    executor_startup_timeout: float = 900.0  # seconds to wait for executors to load
    reconnect_backoff_max: float = 10.0  # longest wait between reconnect attempts
    max_logprobs: int = 20  # most top logprobs a request may ask for
