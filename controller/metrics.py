"""Prometheus metrics of the controller, under the names vLLM exports.

Existing dashboards, autoscalers and endpoint pickers read these names unchanged. Counters are
exposed with a `_total` suffix by prometheus_client.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from controller.runner import ExecutorRunner
    from controller.tracked import Tracked

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0,
)
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000)


class EngineMetrics:
    """The controller's metric families, in a registry of their own."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()  # served at /metrics
        self.model_name = model_name  # value of the model_name label
        r, labels = self.registry, ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Requests running on executors",
                             labels, registry=r)
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled",
                             labels, registry=r)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0-1 (1 = full)",
                              labels, registry=r)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prompt tokens received",
                                     labels, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Tokens generated",
                                         labels, registry=r)
        self.request_success = Counter("vllm:request_success", "Finished requests by reason",
                                       labels + ["finished_reason"], registry=r)
        self.preemptions = Counter("vllm:num_preemptions", "Requests preempted",
                                   labels, registry=r)
        self.prefix_queries = Counter("vllm:prefix_cache_queries",
                                      "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter("vllm:prefix_cache_hits",
                                   "Prompt tokens found in the prefix cache", labels, registry=r)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token",
                              labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between tokens",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Request latency",
                             labels, buckets=_LATENCY_BUCKETS, registry=r)
        self.req_prompt = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request",
                                    labels, buckets=_TOKEN_BUCKETS, registry=r)
        self.req_gen = Histogram("vllm:request_generation_tokens",
                                 "Generated tokens per request", labels,
                                 buckets=_TOKEN_BUCKETS, registry=r)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Tokens per step",
                                          labels, buckets=_TOKEN_BUCKETS, registry=r)
        # Fleet metrics (Tandem's own).
        self.executor_losses = Counter("tandem:executor_lost", "Executors lost mid-stream",
                                       labels, registry=r)
        self.executor_reconnects = Counter("tandem:executor_reconnects",
                                           "Handshakes with an executor after it was lost",
                                           labels, registry=r)
        self.executors = Gauge("tandem:executors", "Executors by state",
                               labels + ["state"], registry=r)
        self.failovers = Counter("tandem:requests_failed_over",
                                 "Requests moved off a lost executor (resumed by recompute)",
                                 labels, registry=r)
        self.rebalances = Counter("tandem:requests_rebalanced",
                                  "Queued requests moved to an executor that could start them",
                                  labels, registry=r)
        self.placements = Counter("tandem:placements", "Placements by reason (affinity|load)",
                                  labels + ["reason"], registry=r)
        self.waiting_for_executor = Gauge("tandem:requests_waiting_for_executor",
                                          "Requests no healthy executor can take now",
                                          labels, registry=r)
        self.failover_pause = Histogram("tandem:failover_pause_seconds",
                                        "From losing a request's executor to its next token",
                                        labels, buckets=_LATENCY_BUCKETS, registry=r)
        self._last: dict[str, tuple[int, int, int]] = {}  # runner -> cumulative counters seen

    def _l(self, metric):
        return metric.labels(model_name=self.model_name)

    def request_arrived(self, num_prompt_tokens: int) -> None:
        self._l(self.prompt_tokens).inc(num_prompt_tokens)
        self._l(self.req_prompt).observe(num_prompt_tokens)

    def tokens_generated(self, tracked: Tracked, count: int, now: float) -> None:
        self._l(self.generation_tokens).inc(count)
        if not tracked.first_token_at:
            tracked.first_token_at = now
            self._l(self.ttft).observe(now - tracked.arrival)
        else:
            self._l(self.itl).observe((now - tracked.last_token_at) / count)
        tracked.last_token_at = now

    def request_finished(self, reason: str | None, tracked: Tracked | None = None,
                         now: float | None = None) -> None:
        self.request_success.labels(
            model_name=self.model_name, finished_reason=reason or "abort"
        ).inc()
        if tracked is not None:
            self._l(self.e2e).observe((now or time.perf_counter()) - tracked.arrival)
            self._l(self.req_gen).observe(tracked.request.num_output_tokens)

    def executor_lost(self) -> None:
        self._l(self.executor_losses).inc()

    def executor_reconnected(self) -> None:
        self._l(self.executor_reconnects).inc()

    def set_executor_states(self, counts: dict[str, int]) -> None:
        for state in ("connecting", "healthy", "unhealthy", "draining"):
            self.executors.labels(model_name=self.model_name, state=state).set(
                counts.get(state, 0))

    def failed_over(self) -> None:
        self._l(self.failovers).inc()

    def rebalanced(self) -> None:
        self._l(self.rebalances).inc()

    def placed(self, reason: str) -> None:
        self.placements.labels(model_name=self.model_name, reason=reason).inc()

    def set_waiting_for_executor(self, count: int) -> None:
        self._l(self.waiting_for_executor).set(count)

    def failover_resumed(self, seconds: float) -> None:
        self._l(self.failover_pause).observe(seconds)

    def scheduler_reset(self, key: str) -> None:
        """An executor's scheduler was rebuilt: its cumulative counters start over."""
        self._last.pop(key, None)

    def step_done(self, runner: ExecutorRunner, num_tokens: int, seconds: float, stats) -> None:
        """Refresh gauges and fold the scheduler's cumulative counters in after a step."""
        self._l(self.iteration_tokens).observe(num_tokens)
        running = waiting = connected = 0
        usage = 0.0
        for r in runner.engine.runners.values():
            if r.scheduler is not None:
                s = r.scheduler.stats() if r is not runner else stats
                running += s.num_running
                waiting += s.num_waiting
                usage += s.kv_usage
                connected += 1
        self._l(self.running).set(running)
        self._l(self.waiting).set(waiting + len(runner.engine.waiting))
        self._l(self.kv_usage).set(usage / max(1, connected))
        key = runner.address
        prev = self._last.get(key, (0, 0, 0))
        cur = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)
        if cur[0] < prev[0] or cur[2] < prev[2]:  # the scheduler was rebuilt
            prev = (0, 0, 0)
        self._l(self.prefix_queries).inc(cur[0] - prev[0])
        self._l(self.prefix_hits).inc(cur[1] - prev[1])
        self._l(self.preemptions).inc(cur[2] - prev[2])
        self._last[key] = cur
