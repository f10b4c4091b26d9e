"""The scheduler interface: what the engine needs from a scheduler, and its data types.

A deployment plugs in its own policy by subclassing `SchedulerBase` and passing
`--scheduler package.module:ClassName` to the controller; `controller.core.scheduler.Scheduler`
is the default implementation.
"""

from __future__ import annotations

import abc
import importlib
from dataclasses import dataclass, field

from common.wire.step_types import StepInput, StepOutput, TokenLogprobs
from controller.core.request import FinishReason, Request

POLICIES = ("fcfs", "priority")


@dataclass
class SchedulerConfig:
    """Limits and switches of one executor's scheduler."""

    max_num_batched_tokens: int = 2048  # token budget of one step
    max_num_seqs: int = 128  # most running requests (and so most requests in a step)
    long_prefill_token_threshold: int = 0  # most tokens of one request per step; 0 = no cap
    policy: str = "fcfs"  # "fcfs" or "priority" (lower Request.priority first)
    enable_prefix_caching: bool = True  # reuse cached full blocks across requests
    chunked_prefill: bool = True  # executor capability: a prompt may span several steps
    block_size: int = 16  # tokens per KV block
    num_blocks: int = 0  # KV blocks of the executor, null block included; must be set (>= 2)
    max_model_len: int = 0  # default Request.max_model_len; 0 = no limit
    sliding_window: int = 0  # every model layer attends to the last N tokens (0 = not all do)

    def validate(self) -> None:
        """Raise ValueError on an unusable configuration."""
        if self.policy not in POLICIES:
            raise ValueError(f"unknown scheduling policy {self.policy!r}; use one of {POLICIES}")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if min(self.long_prefill_token_threshold, self.max_model_len, self.sliding_window) < 0:
            raise ValueError(
                "long_prefill_token_threshold, max_model_len and sliding_window must be >= 0"
            )
        if self.block_size < 1 or self.num_blocks < 2:
            raise ValueError("block_size must be positive and num_blocks at least 2")


@dataclass
class RequestUpdate:
    """What one step changed for one request, for the detokenizer and the client stream."""

    request_id: str  # the request
    new_token_ids: list[int] = field(default_factory=list)  # tokens appended (a stop id included)
    finished: bool = False  # the request has ended
    finish_reason: FinishReason | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprobs] | None = None  # one per new token, when asked for
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)  # prompt positions done
    error: str = ""  # why the request failed, for finish_reason "error"


@dataclass
class SchedulerStats:
    """A snapshot for metrics and placement."""

    num_running: int  # admitted requests
    num_waiting: int  # queued requests, preempted ones included
    kv_usage: float  # fraction of KV blocks in use, 0..1
    num_used_blocks: int  # KV blocks held by requests
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # tokens found there (cumulative)
    num_preemptions: int  # requests preempted (cumulative)
    num_scheduled_tokens: int  # tokens scheduled by the last step


class SchedulerBase(abc.ABC):
    """The interface the engine drives; subclass it to plug in a policy (`--scheduler mod:Class`).

    Contract, per executor and one step at a time:

    - `__init__(config)` gets a `SchedulerConfig`; the KV block pool is the scheduler's to own.
    - `add_request(request)` queues a new `Request` (status WAITING).
    - `schedule()` returns the next `StepInput`: a diff against what the executor holds. A
      request it has not seen (or must recompute) is a `NewRequestData` with its whole block
      table; a known one is a `CachedRequestData` with only its new blocks. Per step the total
      of `num_scheduled_tokens` stays within `token_budget` (at most `max_num_batched_tokens`;
      the engine lowers it to keep a slow executor's steps short) and at most
      `max_num_seqs` requests run. Every id finished, aborted or preempted since the previous
      step goes in `finished_request_ids` (the executor handles those first). `step_id`
      increases by one from 1. A step that schedules no request is not meant to be sent: it
      takes no step id and no finished ids (those ride the next step with work).
    - `update_from_output(step, output)` applies the executor's answer to `step`: advance
      `num_computed_tokens`, append sampled tokens, decide stops, free finished requests'
      blocks, and return one `RequestUpdate` per request with something new. Outputs for
      requests finished in the meantime are ignored.
    - `finish_requests(ids, reason)` ends requests from outside ("abort" from a client that
      left, "stop" for a stop string): free their blocks; unknown or finished ids are ignored.
    - When every request has finished, no KV block may be held.

    A scheduler that sets `supports_pipelining` lets the engine call `schedule()` again before
    the previous step's result is applied (results are then applied in step order); it must
    count tokens in flight itself (the default scheduler's placeholders). Others are driven one
    step at a time.
    """

    #: Whether `schedule()` may run again before the previous step's result is applied.
    supports_pipelining: bool = False

    def __init__(self, config: SchedulerConfig) -> None:
        config.validate()
        self.config = config
        # Tokens the next step may schedule; the engine may lower it before each schedule().
        self.token_budget = config.max_num_batched_tokens

    @abc.abstractmethod
    def add_request(self, request: Request) -> None:
        """Queue a request; ValueError if it can never be scheduled."""

    @abc.abstractmethod
    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """End requests now (client abort, stop string), freeing their blocks."""

    @abc.abstractmethod
    def schedule(self) -> StepInput:
        """Build the next step."""

    @abc.abstractmethod
    def update_from_output(self, step: StepInput, output: StepOutput) -> list[RequestUpdate]:
        """Apply a step's result; return what changed per request."""

    @abc.abstractmethod
    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""

    @property
    @abc.abstractmethod
    def num_running(self) -> int:
        """Admitted requests."""

    @property
    @abc.abstractmethod
    def num_waiting(self) -> int:
        """Queued requests."""

    @abc.abstractmethod
    def stats(self) -> SchedulerStats:
        """Current numbers for metrics."""

    @abc.abstractmethod
    def get_request(self, request_id: str) -> Request | None:
        """A live (unfinished) request, or None."""

    def needs_results_first(self) -> bool:
        """Whether the next step must wait until every step in flight has been applied: a
        constrained request's allowed tokens (see controller.core.output_grammar) depend on
        the token it is sampling. The default scheduler says so while it holds any
        constrained request, so those steps are not pipelined. False unless overridden."""
        return False

    def peek_prefix_hit(self, block_hashes: list[bytes], num_tokens: int) -> int:
        """Tokens of a sequence (its full-block hashes, its length) this executor's prefix
        cache would serve now, without side effects; placement uses it. 0 unless overridden."""
        return 0


def load_scheduler_class(spec: str) -> type[SchedulerBase]:
    """Import a scheduler class named "package.module:ClassName".

    ValueError for a malformed name or a module that does not import; TypeError when the
    object is not a subclass of SchedulerBase.
    """
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise ValueError(f"scheduler {spec!r} is not of the form 'package.module:ClassName'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"cannot import scheduler module {module_name!r}: {exc}") from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type) or not issubclass(cls, SchedulerBase):
        raise TypeError(
            f"{spec!r} is not a subclass of controller.core.scheduler_base.SchedulerBase"
        )
    return cls
