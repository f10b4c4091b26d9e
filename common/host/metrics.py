"""Prometheus metrics an executor serves on its own metrics port (`--metrics-port`).

Step time, size and device memory, labelled with the accelerator kind (gpu, tpu, cpu) and the
device name. They live in the process's default registry, which the metrics port serves; the
controller's view of the same steps (round trip included) is `tandem:step_duration_seconds`.
"""

from __future__ import annotations

import http.server
import threading
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from common.wire.metric_buckets import STEP_REQUEST_BUCKETS, STEP_SECONDS_BUCKETS

if TYPE_CHECKING:
    from common.wire.step_types import StepInput

_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
_LABELS = ["accelerator", "device"]
disable_created_metrics()  # no `_created` series
_lock = threading.Lock()
_families: dict[str, Histogram] = {}  # created once per process
_memory = None  # the process's DeviceMemoryCollector


class MeteredDevice(Protocol):
    """What the metrics read of a worker: its device's labels and memory figures."""

    device_kind: str  # accelerator label: gpu, tpu or cpu
    device_name: str  # device label

    def memory_usage(self) -> dict[str, int]:
        """Bytes by kind (weights, kv_cache, used, total)."""
        ...


class DeviceMemoryCollector(Collector):
    """`tandem:executor_device_memory_bytes{kind}` from the worker's memory_usage() at scrape
    time: weights, kv_cache, used and total bytes of the device (host memory on the CPU)."""

    def __init__(self) -> None:
        self.worker: MeteredDevice | None = None  # the process's worker, once bound

    def collect(self):
        family = GaugeMetricFamily(
            "tandem:executor_device_memory_bytes",
            "Device memory of the executor by kind",
            labels=_LABELS + ["kind"],
        )
        worker = self.worker
        if worker is not None:
            labels = [worker.device_kind, worker.device_name]
            for kind, value in sorted(worker.memory_usage().items()):
                family.add_metric(labels + [kind], float(value))
        yield family

    def describe(self):
        return []


class ExecutorMetrics:
    """Step observations of one worker (the families are shared by the process)."""

    def __init__(self, worker: MeteredDevice):
        global _memory
        with _lock:
            if not _families:
                _families["seconds"] = Histogram(
                    "tandem:executor_step_seconds",
                    "Time the executor spent on a step",
                    _LABELS,
                    buckets=STEP_SECONDS_BUCKETS,
                )
                _families["tokens"] = Histogram(
                    "tandem:executor_step_tokens",
                    "Tokens computed per step",
                    _LABELS,
                    buckets=_TOKEN_BUCKETS,
                )
                _families["requests"] = Histogram(
                    "tandem:executor_step_requests",
                    "Requests per step",
                    _LABELS,
                    buckets=STEP_REQUEST_BUCKETS,
                )
                _memory = DeviceMemoryCollector()
                REGISTRY.register(_memory)
            _memory.worker = worker
        self.worker = worker  # whose device the labels name
        self._children: tuple | None = None  # bound once the device is known

    def observe(self, step: StepInput, seconds: float) -> None:
        """Record one executed step."""
        if self._children is None:
            labels = (self.worker.device_kind, self.worker.device_name)
            self._children = tuple(
                _families[k].labels(*labels) for k in ("seconds", "tokens", "requests")
            )
        seconds_h, tokens_h, requests_h = self._children
        seconds_h.observe(seconds)
        tokens_h.observe(step.num_scheduled_tokens)
        requests_h.observe(step.num_requests)


class _MetricsHandler(http.server.BaseHTTPRequestHandler):
    """GET /metrics in Prometheus' text format 0.0.4. (prometheus_client's own server answers
    scrapers that ask for OpenMetrics with colons escaped, which would rename `tandem:` and
    `vllm:` series.)"""

    def do_GET(self):  # noqa: N802 (http.server's name)
        if self.path.split("?")[0] not in ("/metrics", "/"):
            self.send_error(404)
            return
        body = generate_latest(REGISTRY)
        self.send_response(200)
        self.send_header("Content-Type", CONTENT_TYPE_LATEST)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):  # scrapes are not worth a log line
        pass


def serve_metrics(host: str, port: int) -> http.server.ThreadingHTTPServer:
    """Serve the process's registry at http://host:port/metrics from a daemon thread."""
    server = http.server.ThreadingHTTPServer((host, port), _MetricsHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
