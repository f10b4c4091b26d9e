"""The controller's exposition: vLLM's names and labels, per-executor series, promtool; and the
dashboard JSON in step with scripts/build_dashboard.py. (tests/e2e/test_dashboard_live.py runs the
dashboard's queries against a real Prometheus.)"""

from __future__ import annotations

import importlib.util
import os

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.prom import promtool_problems
from tests.support.processes import ROOT

# Every name ../shared/REFERENCE.md lists for vLLM, as exposed (counters with `_total`).
VLLM_NAMES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}
FLEET_GAUGES = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
)


def _families(server) -> dict:
    client = server.client()
    client.completions.create(model=server.model_name, prompt="Count: one two", max_tokens=4)
    text = httpx.get(server.base_url + "/metrics").text
    return text, {f.name: f for f in text_string_to_metric_families(text)}


def test_vllm_names_and_executor_labels(server):
    _, families = _families(server)
    for name, kind in VLLM_NAMES.items():
        assert name in families, name
        assert families[name].type == kind, (name, families[name].type)
    for name in FLEET_GAUGES:  # what endpoint pickers read: one series per model
        samples = families[name].samples
        assert len(samples) == 1 and set(samples[0].labels) == {"model_name"}, samples
    tokens = [s for s in families["vllm:generation_tokens"].samples if s.value > 0]
    assert tokens and all(s.labels["accelerator"] in ("cpu", "gpu", "tpu") for s in tokens)
    executors = {e["address"] for e in server.executors_state()}
    assert {s.labels["executor"] for s in tokens} <= executors
    per_executor = families["tandem:executor_requests_running"].samples
    assert {s.labels["executor"] for s in per_executor} == executors
    states = families["tandem:executors"].samples
    assert sum(s.value for s in states if s.labels["state"] == "healthy") == len(executors)
    for name in (
        "tandem:step_duration_seconds",
        "tandem:executor_lost",
        "tandem:requests_failed_over",
        "tandem:executor_reconnects",
        "tandem:executor_healthy",
        "tandem:executor_kv_cache_usage_perc",
    ):
        assert name in families, name


def test_controller_exposition_passes_promtool(server):
    text, _ = _families(server)
    assert promtool_problems(text) == []


def test_promtool_reports_a_real_problem():
    """The filter lets only the deliberate colon-name findings through."""
    bad = "# TYPE x counter\nx 1\n# TYPE x gauge\n"
    assert promtool_problems(bad)
    assert promtool_problems("# HELP a_total b\n# TYPE a_total gauge\na_total 1\n")


def test_dashboard_json_is_generated():
    path = os.path.join(ROOT, "scripts/build_dashboard.py")
    spec = importlib.util.spec_from_file_location("build_dashboard", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with open(module.OUT) as f:
        assert f.read() == module.render(), "run python scripts/build_dashboard.py"


def test_observe_many_equals_repeated_observe():
    import pytest
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from controller.observe.metrics import observe_many

    def exposition(bulk: bool) -> dict:
        registry = CollectorRegistry()
        hist = Histogram("h", "h", ["x"], buckets=(0.01, 0.1, 1.0), registry=registry)
        child = hist.labels("a")
        for amount, times in ((0.005, 3), (0.01, 2), (0.5, 4), (7.0, 1), (0.1, 5)):
            if bulk:
                observe_many(child, amount, times)
            else:
                for _ in range(times):
                    child.observe(amount)
        text = generate_latest(registry).decode()
        return {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
        }

    bulk, single = exposition(bulk=True), exposition(bulk=False)
    assert bulk.keys() == single.keys()
    for key, value in single.items():  # counts exactly, the sum up to rounding
        assert bulk[key] == pytest.approx(value, rel=1e-12), key
