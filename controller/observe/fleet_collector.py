"""Gauges of the fleet, computed when Prometheus scrapes (never stale, nothing per step).

Fleet-wide, one series per model, under vLLM's names: running and waiting requests and KV-cache
usage (what endpoint pickers and autoscalers read). Per executor, under `tandem:` names with
`executor` and `accelerator` labels: health, running and waiting requests, KV blocks and usage,
and vLLM's `cache_config_info`. Executors by accelerator kind and state.

The collector reads executor snapshots through a callable it is given (the engine's), so it
knows nothing of the engine or its sessions.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from controller.core.snapshot import ExecutorSnapshot

# Yields the fleet at scrape time: a snapshot per executor, and how many requests wait for an
# executor (none can take them now).
FleetReader = Callable[[], "tuple[Iterable[ExecutorSnapshot], int]"]

STATES = (
    "connecting",
    "healthy",
    "unhealthy",
    "draining",
    "duplicate",
    "owned_elsewhere",
    "assigned_elsewhere",
)
ACCELERATORS = ("gpu", "tpu", "cpu")


class FleetCollector(Collector):
    """Reads the fleet's executor snapshots at scrape time."""

    def __init__(self, read_fleet: FleetReader, model_name: str, prefix_caching: bool):
        self.read_fleet = read_fleet  # the fleet now: snapshots, requests waiting for one
        self.model_name = model_name  # value of the model_name label
        self.prefix_caching = str(prefix_caching)  # the enable_prefix_caching label

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
        device_info = GaugeMetricFamily(
            "tandem:executor_info",
            "1 per connected executor: its device and how many devices it shards the model over",
            labels=ex + ["device", "tensor_parallel_size"],
        )
        no_executor = GaugeMetricFamily(
            "tandem:requests_waiting_for_executor",
            "Requests no healthy executor can take now",
            labels=["model_name"],
        )
        counts: Counter[tuple[str, str]] = Counter()
        total_running = total_waiting = used_blocks = all_blocks = 0
        snapshots, queued = self.read_fleet()
        for snap in snapshots:
            kind = snap.kind if snap.kind is not None else "unknown"
            counts[(kind, snap.state)] += 1
            labels = [m, snap.address, kind]
            healthy.add_metric(labels, 1.0 if snap.healthy else 0.0)
            if not snap.connected:
                continue
            blocks = max(snap.num_blocks - 1, 0)
            total_running += snap.running
            total_waiting += snap.waiting
            used_blocks += snap.used_blocks
            all_blocks += blocks
            device_info.add_metric(
                labels + [snap.device or "", str(snap.tensor_parallel_size)], 1.0
            )
            ex_running.add_metric(labels, snap.running)
            ex_waiting.add_metric(labels, snap.waiting)
            ex_usage.add_metric(labels, snap.kv_usage)
            ex_blocks.add_metric(labels + ["used"], snap.used_blocks)
            ex_blocks.add_metric(labels + ["total"], blocks)
            info.add_metric(
                labels + [str(snap.block_size), str(snap.num_blocks), self.prefix_caching], 1.0
            )
        for kind in sorted(set(ACCELERATORS) | {k for k, _ in counts}):
            for state in STATES:
                kinds.add_metric([m, kind, state], counts.get((kind, state), 0))
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
            device_info,
            no_executor,
        )

    def describe(self):
        return []  # collected at scrape time only (the registry must not call collect early)
