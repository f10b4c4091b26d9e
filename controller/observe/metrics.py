"""Prometheus metrics of the controller, under the names vLLM exports, per executor.

Existing dashboards, autoscalers and endpoint pickers read the `vllm:` names unchanged. Counters
and histograms carry `executor` (host:port) and `accelerator` (gpu, tpu, cpu) labels besides
`model_name`, so `sum()` gives the fleet and `by (accelerator)` compares device kinds; events
with no executor (a request aborted while waiting for one) are labelled "none". The gauges an
endpoint picker or autoscaler reads (`vllm:num_requests_running`, `vllm:num_requests_waiting`,
`vllm:kv_cache_usage_perc`) are fleet-wide, one series per model; their per-executor values are
`tandem:executor_*` gauges, computed at scrape time (see controller/observe/fleet_collector.py).
Counters are exposed with a `_total` suffix by prometheus_client.

Nothing here knows the fleet: events carry plain values, a request's `RequestStats`, and the
`ExecutorSeries` handle an executor session binds once (and again when its accelerator label
changes), so the per-step and per-token path does no label lookup.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from common.wire.metric_buckets import STEP_REQUEST_BUCKETS, STEP_SECONDS_BUCKETS

if TYPE_CHECKING:
    from controller.core.scheduler_base import SchedulerStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)
FINISH_REASONS = ("stop", "length", "abort", "error")
NO_EXECUTOR = "none"  # executor/accelerator label of events that happened on no executor
_EXEC = ["model_name", "executor", "accelerator"]
disable_created_metrics()  # no `_created` series: half the exposition, nothing reads them


@dataclass(slots=True)
class RequestStats:
    """What the metrics keep of one request across its executors: its prompt length and when
    it reached each stage (perf_counter seconds; 0 = not yet)."""

    arrival: float  # when the controller received it
    prompt_tokens: int  # its prompt length, counted as prefilled at its first token
    scheduled_at: float = 0.0  # first scheduled: its queue time ends (its session stamps it)
    first_token_at: float = 0.0  # its first token
    last_token_at: float = 0.0  # its latest token


@dataclass
class ExecutorSeries:
    """The metric children of one executor (bound once: the hot path does no label lookup)."""

    executor: str  # the executor label (host:port)
    accelerator: str  # the accelerator label (gpu, tpu, cpu)
    prompt_tokens: Any  # Counter child
    generation_tokens: Any  # Counter child
    success: dict[str, Any]  # finish reason -> Counter child
    preemptions: Any  # Counter child
    prefix_queries: Any  # Counter child
    prefix_hits: Any  # Counter child
    ttft: Any  # Histogram child
    itl: Any  # Histogram child
    e2e: Any  # Histogram child
    queue_time: Any  # Histogram child
    prefill_time: Any  # Histogram child
    decode_time: Any  # Histogram child
    req_prompt: Any  # Histogram child
    req_gen: Any  # Histogram child
    iteration_tokens: Any  # Histogram child
    step_seconds: Any  # Histogram child
    step_requests: Any  # Histogram child
    lost: Any  # Counter child
    reconnects: Any  # Counter child
    failovers: Any  # Counter child (requests moved off this executor)
    failover_pause: Any  # Histogram child (pauses of requests resumed here)


class EngineMetrics:
    """The controller's metric families, in a registry of their own."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()  # served at /metrics
        self.model_name = model_name  # value of the model_name label
        r = self.registry

        def counter(name: str, doc: str, extra=()):
            return Counter(name, doc, _EXEC + list(extra), registry=r)

        def histogram(name: str, doc: str, buckets):
            return Histogram(name, doc, _EXEC, buckets=buckets, registry=r)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens prefilled")
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated")
        self.request_success = counter(
            "vllm:request_success", "Finished requests by reason", ["finished_reason"]
        )
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted")
        self.prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = counter(
            "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache"
        )
        self.ttft = histogram(
            "vllm:time_to_first_token_seconds", "Time to first token", _LATENCY_BUCKETS
        )
        self.itl = histogram(
            "vllm:inter_token_latency_seconds", "Time between tokens", _LATENCY_BUCKETS
        )
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Request latency", _LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "vllm:request_queue_time_seconds", "From arrival to first scheduled", _LATENCY_BUCKETS
        )
        self.prefill_time = histogram(
            "vllm:request_prefill_time_seconds",
            "From first scheduled to first token",
            _LATENCY_BUCKETS,
        )
        self.decode_time = histogram(
            "vllm:request_decode_time_seconds", "From first token to the last", _LATENCY_BUCKETS
        )
        self.req_prompt = histogram(
            "vllm:request_prompt_tokens", "Prompt tokens per request", _TOKEN_BUCKETS
        )
        self.req_gen = histogram(
            "vllm:request_generation_tokens", "Generated tokens per request", _TOKEN_BUCKETS
        )
        self.iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Tokens per step", _TOKEN_BUCKETS
        )
        # Fleet metrics (Tandem's own).
        self.step_seconds = histogram(
            "tandem:step_duration_seconds",
            "Step round trip as the controller sees it",
            STEP_SECONDS_BUCKETS,  # shared with the executors' step histograms
        )
        self.step_requests = histogram(
            "tandem:step_requests", "Requests per step", STEP_REQUEST_BUCKETS
        )
        self.executor_losses = counter("tandem:executor_lost", "Executor sessions lost")
        self.executor_reconnects = counter(
            "tandem:executor_reconnects", "Handshakes with an executor after it was lost"
        )
        self.grpc_errors = counter(
            "tandem:executor_grpc_errors",
            "Failed calls to an executor by gRPC status code",
            ["code"],
        )
        self.failovers = counter(
            "tandem:requests_failed_over",
            "Requests moved off a lost executor (resumed by recompute)",
        )
        self.failover_pause = histogram(
            "tandem:failover_pause_seconds",
            "From losing a request's executor to its next token "
            "(labelled by the executor it resumed on)",
            _LATENCY_BUCKETS,
        )
        self.rebalances = Counter(
            "tandem:requests_rebalanced",
            "Queued requests moved to an executor that could start them",
            ["model_name"],
            registry=r,
        )
        self.placements = Counter(
            "tandem:placements",
            "Placements by reason (affinity|load)",
            ["model_name", "reason"],
            registry=r,
        )
        for reason in ("affinity", "load"):
            self.placements.labels(model_name, reason)
        self.rebalances.labels(model_name)
        self._series: dict[str, ExecutorSeries] = {}  # executor address -> its children
        self._none: ExecutorSeries | None = None  # events on no executor, bound on first use
        self._last: dict[str, tuple[int, int, int]] = {}  # executor -> cumulative counters seen
        self._step_tokens = 0  # tokens of the step being applied, counted at its step_done
        self._step_itl: dict[float, int] = {}  # its inter-token latencies -> how many

    # --- executor series --------------------------------------------------------------------
    def _bind(self, executor: str, accelerator: str) -> ExecutorSeries:
        labels = (self.model_name, executor, accelerator)
        s = ExecutorSeries(
            executor=executor,
            accelerator=accelerator,
            prompt_tokens=self.prompt_tokens.labels(*labels),
            generation_tokens=self.generation_tokens.labels(*labels),
            success={
                reason: self.request_success.labels(*labels, reason) for reason in FINISH_REASONS
            },
            preemptions=self.preemptions.labels(*labels),
            prefix_queries=self.prefix_queries.labels(*labels),
            prefix_hits=self.prefix_hits.labels(*labels),
            ttft=self.ttft.labels(*labels),
            itl=self.itl.labels(*labels),
            e2e=self.e2e.labels(*labels),
            queue_time=self.queue_time.labels(*labels),
            prefill_time=self.prefill_time.labels(*labels),
            decode_time=self.decode_time.labels(*labels),
            req_prompt=self.req_prompt.labels(*labels),
            req_gen=self.req_gen.labels(*labels),
            iteration_tokens=self.iteration_tokens.labels(*labels),
            step_seconds=self.step_seconds.labels(*labels),
            step_requests=self.step_requests.labels(*labels),
            lost=self.executor_losses.labels(*labels),
            reconnects=self.executor_reconnects.labels(*labels),
            failovers=self.failovers.labels(*labels),
            failover_pause=self.failover_pause.labels(*labels),
        )
        return s

    def series(self, executor: str, accelerator: str) -> ExecutorSeries:
        """The children of one executor's series (created, at zero, on first use). A session
        binds it once and again when its accelerator label changes (another device answers)."""
        s = self._series.get(executor)
        if s is None or s.accelerator != accelerator:
            s = self._series[executor] = self._bind(executor, accelerator)
        return s

    def remove_executor(self, executor: str) -> None:
        """Drop every series labelled with this executor (it left the fleet): /metrics stops
        showing it instead of keeping its last values forever."""
        self._series.pop(executor, None)
        self._last.pop(executor, None)
        for family in self._families():
            names = family._labelnames
            at = names.index("executor")
            # prometheus_client keeps a family's children by label values (no public listing).
            for labels in [k for k in list(family._metrics) if k[at] == executor]:
                family.remove(*labels)

    def _families(self) -> list[Any]:
        """The labelled families with an `executor` label."""
        return [
            m
            for m in vars(self).values()
            if isinstance(m, (Counter, Histogram)) and "executor" in m._labelnames
        ]

    def _no_executor(self) -> ExecutorSeries:
        if self._none is None:
            self._none = self._bind(NO_EXECUTOR, NO_EXECUTOR)
        return self._none

    # --- request events ---------------------------------------------------------------------

    def request_scheduled(self, s: ExecutorSeries, queued_seconds: float) -> None:
        """A request was scheduled the first time, after `queued_seconds` in queues."""
        s.queue_time.observe(queued_seconds)

    def tokens_generated(self, s: ExecutorSeries, r: RequestStats, count: int, now: float) -> None:
        """A request got `count` tokens at `now`. The token count and the inter-token latency
        are folded in at the step's `step_done`: the requests of a decode step share one
        latency (the time since the previous step), observed once with their number."""
        self._step_tokens += count
        if not r.first_token_at:
            r.first_token_at = now
            s.ttft.observe(now - r.arrival)
            s.prompt_tokens.inc(r.prompt_tokens)
            if r.scheduled_at:
                s.prefill_time.observe(now - r.scheduled_at)
        else:
            gap = (now - r.last_token_at) / count
            self._step_itl[gap] = self._step_itl.get(gap, 0) + 1
        r.last_token_at = now

    def request_finished(
        self,
        reason: str | None,
        r: RequestStats | None = None,
        output_tokens: int | None = None,
        now: float | None = None,
        s: ExecutorSeries | None = None,
    ) -> None:
        """A request ended (on executor series `s`; None: while on no executor)."""
        if s is None:
            s = self._no_executor()
        s.success.get(reason or "abort", s.success["abort"]).inc()
        if r is not None:
            now = now or time.perf_counter()
            s.e2e.observe(now - r.arrival)
            s.req_prompt.observe(r.prompt_tokens)
            if output_tokens is not None:
                s.req_gen.observe(output_tokens)
            if r.first_token_at:
                s.decode_time.observe(now - r.first_token_at)

    # --- fleet events -----------------------------------------------------------------------

    def executor_lost(self, s: ExecutorSeries) -> None:
        s.lost.inc()

    def executor_reconnected(self, s: ExecutorSeries) -> None:
        s.reconnects.inc()

    def grpc_error(self, s: ExecutorSeries, code: str) -> None:
        """A call to the executor failed with this gRPC status code (or UNREACHABLE)."""
        self.grpc_errors.labels(self.model_name, s.executor, s.accelerator, code).inc()

    def failed_over(self, s: ExecutorSeries, count: int) -> None:
        """`count` requests were moved off the lost executor of series `s`."""
        s.failovers.inc(count)

    def failover_resumed(self, s: ExecutorSeries, seconds: float) -> None:
        s.failover_pause.observe(seconds)

    def rebalanced(self) -> None:
        self.rebalances.labels(self.model_name).inc()

    def placed(self, reason: str) -> None:
        self.placements.labels(self.model_name, reason).inc()

    def scheduler_reset(self, executor: str) -> None:
        """An executor's scheduler was rebuilt: its cumulative counters start over."""
        self._last.pop(executor, None)

    def step_done(
        self,
        s: ExecutorSeries,
        num_tokens: int,
        num_requests: int,
        seconds: float,
        stats: SchedulerStats,
    ) -> None:
        """Observe a step and fold the scheduler's cumulative counters in."""
        if self._step_tokens:
            s.generation_tokens.inc(self._step_tokens)
            self._step_tokens = 0
            for gap, times in self._step_itl.items():
                observe_many(s.itl, gap, times)
            self._step_itl.clear()
        s.iteration_tokens.observe(num_tokens)
        s.step_seconds.observe(seconds)
        s.step_requests.observe(num_requests)
        key = s.executor
        prev = self._last.get(key, (0, 0, 0))
        cur = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        if cur[0] < prev[0] or cur[2] < prev[2]:  # the scheduler was rebuilt
            prev = (0, 0, 0)
        if cur != prev:
            s.prefix_queries.inc(cur[0] - prev[0])
            s.prefix_hits.inc(cur[1] - prev[1])
            s.preemptions.inc(cur[2] - prev[2])
            self._last[key] = cur


def observe_many(histogram: Any, amount: float, times: int) -> None:
    """``histogram.observe(amount)`` ``times`` times, in one update of its sum and bucket.

    prometheus_client keeps one non-cumulative count per bucket (``_buckets``, bounds in
    ``_upper_bounds``, ``+Inf`` last) and ``_sum``; tests check this against ``observe``."""
    histogram._raise_if_not_observable()
    histogram._sum.inc(amount * times)
    histogram._buckets[bisect.bisect_left(histogram._upper_bounds, amount)].inc(times)
