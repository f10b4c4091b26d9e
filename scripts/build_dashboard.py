"""Writes the Grafana dashboard of the chart (charts/tandem/dashboards/tandem-overview.json).

The panels are listed here as (title, unit, [(legend, PromQL)]) so the queries are readable and
reviewed in one place; tests/e2e/test_dashboard_live.py runs every query against a real Prometheus
scraping a live fleet, and tests/e2e/test_metrics_format.py checks the JSON matches this script.
Run: python scripts/build_dashboard.py [--check]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parent.parent / "charts/tandem/dashboards/tandem-overview.json"
M = 'model_name=~"$model_name"'
A = 'accelerator=~"$accelerator"'
MA = f"{M},{A}"
W = "[$__rate_interval]"


def rate(metric: str, sel: str = MA, by: str = "") -> str:
    grouping = f" by ({by})" if by else ""
    return f"sum{grouping} (rate({metric}{{{sel}}}{W}))"


def quantile(q: float, metric: str, by: str = "", sel: str = MA) -> str:
    keys = "le" + (f", {by}" if by else "")
    return f"histogram_quantile({q}, sum by ({keys}) (rate({metric}_bucket{{{sel}}}{W})))"


def latency(metric: str, by: str = "") -> list[tuple[str, str]]:
    prefix = "{{" + by + "}} " if by else ""
    return [(f"{prefix}p{int(q * 100)}", quantile(q, metric, by)) for q in (0.5, 0.9, 0.99)]


# (row title, [(panel title, unit, description, [(legend, expr)])])
ROWS: list[tuple[str, list[tuple[str, str, str, list[tuple[str, str]]]]]] = [
    (
        "Fleet overview",
        [
            (
                "Requests per second",
                "reqps",
                "Finished requests per second by finish reason.",
                [("{{finished_reason}}", rate("vllm:request_success_total", by="finished_reason"))],
            ),
            (
                "Tokens per second",
                "short",
                "Prompt tokens prefilled and tokens generated.",
                [
                    ("prompt", rate("vllm:prompt_tokens_total")),
                    ("generated", rate("vllm:generation_tokens_total")),
                ],
            ),
            (
                "Time to first token",
                "s",
                "From arrival to the first token.",
                latency("vllm:time_to_first_token_seconds"),
            ),
            (
                "Inter-token latency",
                "s",
                "Between consecutive tokens of a request.",
                latency("vllm:inter_token_latency_seconds"),
            ),
            (
                "End-to-end latency",
                "s",
                "From arrival to the last token.",
                latency("vllm:e2e_request_latency_seconds"),
            ),
            (
                "Queue time",
                "s",
                "From arrival to first scheduled on an executor.",
                latency("vllm:request_queue_time_seconds"),
            ),
            (
                "Queue depth",
                "short",
                "Requests running, waiting for a step, and waiting for any healthy executor.",
                [
                    ("running", f"sum(vllm:num_requests_running{{{M}}})"),
                    ("waiting", f"sum(vllm:num_requests_waiting{{{M}}})"),
                    ("no executor", f"sum(tandem:requests_waiting_for_executor{{{M}}})"),
                ],
            ),
            (
                "Fleet KV-cache usage",
                "percentunit",
                "Used KV blocks over all blocks of the fleet.",
                [("{{model_name}}", f"max by (model_name) (vllm:kv_cache_usage_perc{{{M}}})")],
            ),
        ],
    ),
    (
        "Health and faults",
        [
            (
                "Executors by accelerator and state",
                "short",
                "Executors the controller knows.",
                [
                    (
                        "{{accelerator}} {{state}}",
                        f"sum by (accelerator, state) (tandem:executors{{{MA}}}) > 0",
                    )
                ],
            ),
            (
                "Executor health",
                "short",
                "1 while an executor takes new work.",
                [
                    (
                        "{{executor}} ({{accelerator}})",
                        f"max by (executor, accelerator) (tandem:executor_healthy{{{MA}}})",
                    )
                ],
            ),
            (
                "Preemptions, failovers, lost executors",
                "short",
                "Per second.",
                [
                    ("preemptions", rate("vllm:num_preemptions_total")),
                    ("requests failed over", rate("tandem:requests_failed_over_total")),
                    ("executors lost", rate("tandem:executor_lost_total")),
                    ("reconnects", rate("tandem:executor_reconnects_total")),
                ],
            ),
            (
                "gRPC errors",
                "short",
                "Failed calls to executors per second, by status code.",
                [
                    (
                        "{{executor}} {{code}}",
                        rate("tandem:executor_grpc_errors_total", by="executor, code"),
                    )
                ],
            ),
        ],
    ),
    (
        "GPU vs TPU",
        [
            (
                "Generated tokens/s by accelerator",
                "short",
                "Throughput per accelerator kind.",
                [("{{accelerator}}", rate("vllm:generation_tokens_total", by="accelerator"))],
            ),
            (
                "TTFT p90 by accelerator",
                "s",
                "Where the first token was computed.",
                [
                    (
                        "{{accelerator}}",
                        quantile(0.9, "vllm:time_to_first_token_seconds", "accelerator"),
                    )
                ],
            ),
            (
                "Inter-token latency p50/p90 by accelerator",
                "s",
                "Decode speed per kind.",
                [
                    (
                        "{{accelerator}} p50",
                        quantile(0.5, "vllm:inter_token_latency_seconds", "accelerator"),
                    ),
                    (
                        "{{accelerator}} p90",
                        quantile(0.9, "vllm:inter_token_latency_seconds", "accelerator"),
                    ),
                ],
            ),
            (
                "Step time by accelerator",
                "s",
                "Executor compute time (executor metric) and the controller's round trip.",
                [
                    (
                        "{{accelerator}} device p90",
                        quantile(0.9, "tandem:executor_step_seconds", "accelerator", sel=A),
                    ),
                    (
                        "{{accelerator}} round trip p90",
                        quantile(0.9, "tandem:step_duration_seconds", "accelerator"),
                    ),
                ],
            ),
        ],
    ),
    (
        "Per executor",
        [
            (
                "KV-cache usage per executor",
                "percentunit",
                "Used over all KV blocks.",
                [
                    (
                        "{{executor}} ({{accelerator}})",
                        "max by (executor, accelerator) "
                        f"(tandem:executor_kv_cache_usage_perc{{{MA}}})",
                    )
                ],
            ),
            (
                "Prefix-cache hit rate per executor",
                "percentunit",
                "Prompt tokens found cached over prompt tokens looked up.",
                [
                    (
                        "{{executor}}",
                        f"{rate('vllm:prefix_cache_hits_total', by='executor')} / "
                        f"{rate('vllm:prefix_cache_queries_total', by='executor')}",
                    )
                ],
            ),
            (
                "Requests per executor",
                "short",
                "Running and queued on each executor.",
                [
                    (
                        "{{executor}} running",
                        f"sum by (executor) (tandem:executor_requests_running{{{MA}}})",
                    ),
                    (
                        "{{executor}} waiting",
                        f"sum by (executor) (tandem:executor_requests_waiting{{{MA}}})",
                    ),
                ],
            ),
            (
                "Tokens per step",
                "short",
                "Mean scheduled tokens and requests per step.",
                [
                    (
                        "{{executor}} tokens",
                        f"{rate('vllm:iteration_tokens_total_sum', by='executor')}"
                        f" / {rate('vllm:iteration_tokens_total_count', by='executor')}",
                    ),
                    (
                        "{{executor}} requests",
                        f"{rate('tandem:step_requests_sum', by='executor')} / "
                        f"{rate('tandem:step_requests_count', by='executor')}",
                    ),
                ],
            ),
            (
                "Step time per executor",
                "s",
                "The controller's step round trip, p50 and p90.",
                [
                    ("{{executor}} p50", quantile(0.5, "tandem:step_duration_seconds", "executor")),
                    ("{{executor}} p90", quantile(0.9, "tandem:step_duration_seconds", "executor")),
                ],
            ),
            (
                "Executor device memory",
                "bytes",
                "Weights, KV cache and device use, from each executor's metrics port.",
                [
                    (
                        "{{instance}} {{kind}}",
                        f"max by (instance, kind) (tandem:executor_device_memory_bytes{{{A}}})",
                    )
                ],
            ),
        ],
    ),
]


def _panel(pid: int, title: str, unit: str, description: str, targets, x: int, y: int) -> dict:
    ds = {"type": "prometheus", "uid": "${datasource}"}
    return {
        "id": pid,
        "type": "timeseries",
        "title": title,
        "description": description,
        "datasource": ds,
        "gridPos": {"x": x, "y": y, "w": 12, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "options": {
            "legend": {"displayMode": "list", "placement": "bottom"},
            "tooltip": {"mode": "multi"},
        },
        "targets": [
            {"refId": chr(ord("A") + i), "datasource": ds, "expr": expr, "legendFormat": legend}
            for i, (legend, expr) in enumerate(targets)
        ],
    }


def _variable(name: str, label: str, query: str) -> dict:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": {"type": "prometheus", "uid": "${datasource}"},
        "query": {"query": query, "refId": name},
        "definition": query,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "refresh": 2,
        "current": {},
        "hide": 0,
    }


def build() -> dict:
    """The dashboard as a dict (Grafana schema 39)."""
    panels, pid, y = [], 1, 0
    for row_title, row in ROWS:
        panels.append(
            {
                "id": pid,
                "type": "row",
                "title": row_title,
                "collapsed": False,
                "gridPos": {"x": 0, "y": y, "w": 24, "h": 1},
                "panels": [],
            }
        )
        pid, y = pid + 1, y + 1
        for i, (title, unit, description, targets) in enumerate(row):
            panels.append(_panel(pid, title, unit, description, targets, 12 * (i % 2), y))
            pid += 1
            if i % 2 == 1 or i == len(row) - 1:
                y += 8
    return {
        "uid": "tandem-overview",
        "title": "Tandem overview",
        "tags": ["tandem", "llm"],
        "description": "Tandem fleet: load, latency, GPU vs TPU, executors, faults.",
        "editable": True,
        "schemaVersion": 39,
        "version": 2,
        "refresh": "30s",
        "time": {"from": "now-1h", "to": "now"},
        "timezone": "browser",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                _variable(
                    "model_name", "Model", "label_values(vllm:num_requests_running, model_name)"
                ),
                _variable(
                    "accelerator",
                    "Accelerator",
                    "label_values(tandem:executor_healthy, accelerator)",
                ),
            ]
        },
        "annotations": {"list": []},
        "panels": panels,
    }


def render() -> str:
    """The JSON text written to the chart."""
    return json.dumps(build(), indent=1) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="fail if the file is out of date")
    args = p.parse_args()
    text = render()
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT} is out of date: run python scripts/build_dashboard.py", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
