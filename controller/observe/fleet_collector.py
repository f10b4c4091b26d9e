"""Gauges of the fleet, computed when Prometheus scrapes (never stale, nothing per step).

Fleet-wide, one series per model, under vLLM's names: running and waiting requests and KV-cache
usage (what endpoint pickers and autoscalers read). Per executor, under `tandem:` names with
`executor` and `accelerator` labels: health, running and waiting requests, KV blocks and usage,
and vLLM's `cache_config_info`. Executors by accelerator kind and state.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controller.fleet.engine import Engine

STATES = ("connecting", "healthy", "unhealthy", "draining")
ACCELERATORS = ("gpu", "tpu", "cpu")


class FleetCollector(Collector):
    """Reads the engine's runners and schedulers at scrape time."""

    def __init__(self, engine: Engine, model_name: str):
        self.engine = engine  # whose fleet is described
        self.model_name = model_name  # value of the model_name label

    def collect(self):
        m = self.model_name
        ex = ["model_name", "executor", "accelerator"]
        running = GaugeMetricFamily(
            "vllm:num_requests_running", "Requests running on executors", labels=["model_name"]
        )
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting",
            "Requests waiting to be scheduled (fleet)",
            labels=["model_name"],
        )
        usage = GaugeMetricFamily(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage of the fleet, 0-1 (used / all blocks)",
            labels=["model_name"],
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "KV-cache configuration",
            labels=ex + ["block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        kinds = GaugeMetricFamily(
            "tandem:executors",
            "Executors by accelerator and state",
            labels=["model_name", "accelerator", "state"],
        )
        healthy = GaugeMetricFamily(
            "tandem:executor_healthy", "1 while the executor takes new work", labels=ex
        )
        ex_running = GaugeMetricFamily(
            "tandem:executor_requests_running", "Requests running on the executor", labels=ex
        )
        ex_waiting = GaugeMetricFamily(
            "tandem:executor_requests_waiting", "Requests queued for the executor", labels=ex
        )
        ex_usage = GaugeMetricFamily(
            "tandem:executor_kv_cache_usage_perc", "KV-cache usage of the executor, 0-1", labels=ex
        )
        ex_blocks = GaugeMetricFamily(
            "tandem:executor_kv_blocks",
            "KV blocks of the executor (null block excluded)",
            labels=ex + ["state"],
        )
        no_executor = GaugeMetricFamily(
            "tandem:requests_waiting_for_executor",
            "Requests no healthy executor can take now",
            labels=["model_name"],
        )
        counts: Counter[tuple[str, str]] = Counter()
        total_running = total_waiting = used_blocks = all_blocks = 0
        for runner in list(self.engine.runners.values()):
            kind = runner.info.device_kind if runner.info is not None else "unknown"
            counts[(kind, runner.state.value)] += 1
            labels = [m, runner.address, kind]
            healthy.add_metric(labels, 1.0 if runner.healthy else 0.0)
            sched = runner.scheduler
            if sched is None:
                continue
            s = sched.stats()
            blocks = max(runner.num_blocks - 1, 0)
            total_running += s.num_running
            total_waiting += s.num_waiting
            used_blocks += s.num_used_blocks
            all_blocks += blocks
            ex_running.add_metric(labels, s.num_running)
            ex_waiting.add_metric(labels, s.num_waiting)
            ex_usage.add_metric(labels, s.kv_usage)
            ex_blocks.add_metric(labels + ["used"], s.num_used_blocks)
            ex_blocks.add_metric(labels + ["total"], blocks)
            info.add_metric(
                labels
                + [
                    str(runner.block_size),
                    str(runner.num_blocks),
                    str(self.engine.config.enable_prefix_caching),
                ],
                1.0,
            )
        for kind in sorted(set(ACCELERATORS) | {k for k, _ in counts}):
            for state in STATES:
                kinds.add_metric([m, kind, state], counts.get((kind, state), 0))
        queued = len(self.engine.waiting)
        running.add_metric([m], total_running)
        waiting.add_metric([m], total_waiting + queued)
        usage.add_metric([m], used_blocks / all_blocks if all_blocks else 0.0)
        no_executor.add_metric([m], queued)
        yield from (
            running,
            waiting,
            usage,
            info,
            kinds,
            healthy,
            ex_running,
            ex_waiting,
            ex_usage,
            ex_blocks,
            no_executor,
        )

    def describe(self):
        return []  # collected at scrape time only (the registry must not call collect early)
