"""The controller's metrics without the fleet: events carry plain values, a per-executor
series handle and a request's `RequestStats`."""

from __future__ import annotations

from prometheus_client import generate_latest

from controller.core.scheduler_base import SchedulerStats
from controller.observe.metrics import EngineMetrics, RequestStats


def _value(metrics: EngineMetrics, name: str, **labels) -> float | None:
    return metrics.registry.get_sample_value(name, {"model_name": "m", **labels})


def _stats(queries: int, hits: int, preemptions: int) -> SchedulerStats:
    return SchedulerStats(1, 0, 0.1, 3, queries, hits, preemptions, 8)


def test_a_request_timed_across_its_stages_on_one_executor_series():
    m = EngineMetrics("m")
    s = m.series("e:1", "gpu")
    assert m.series("e:1", "gpu") is s  # bound once
    r = RequestStats(arrival=10.0, prompt_tokens=7)
    r.scheduled_at = 10.5  # the session stamps it when the step goes out
    m.request_scheduled(s, r.scheduled_at - r.arrival)
    m.tokens_generated(s, r, 1, 11.0)  # first token
    m.step_done(s, 8, 1, 0.5, _stats(16, 0, 0))
    m.tokens_generated(s, r, 2, 12.0)  # two more, 0.5 s apart each
    m.step_done(s, 2, 1, 1.0, _stats(16, 0, 0))
    m.request_finished("length", r, 3, 12.0, s)
    ex = {"executor": "e:1", "accelerator": "gpu"}
    assert (r.first_token_at, r.last_token_at) == (11.0, 12.0)
    assert _value(m, "vllm:request_queue_time_seconds_sum", **ex) == 0.5
    assert _value(m, "vllm:time_to_first_token_seconds_sum", **ex) == 1.0
    assert _value(m, "vllm:request_prefill_time_seconds_sum", **ex) == 0.5
    assert _value(m, "vllm:inter_token_latency_seconds_count", **ex) == 1
    assert _value(m, "vllm:inter_token_latency_seconds_sum", **ex) == 0.5
    assert _value(m, "vllm:prompt_tokens_total", **ex) == 7
    assert _value(m, "vllm:generation_tokens_total", **ex) == 3
    assert _value(m, "vllm:e2e_request_latency_seconds_sum", **ex) == 2.0
    assert _value(m, "vllm:request_decode_time_seconds_sum", **ex) == 1.0
    assert _value(m, "vllm:request_generation_tokens_sum", **ex) == 3
    assert _value(m, "vllm:request_success_total", **ex, finished_reason="length") == 1
    assert _value(m, "vllm:prefix_cache_queries_total", **ex) == 16


def test_scheduler_counters_fold_in_and_start_over_after_a_reset():
    m = EngineMetrics("m")
    s = m.series("e:1", "cpu")
    ex = {"executor": "e:1", "accelerator": "cpu"}
    m.step_done(s, 1, 1, 0.1, _stats(32, 16, 1))
    m.step_done(s, 1, 1, 0.1, _stats(48, 16, 1))
    assert _value(m, "vllm:prefix_cache_queries_total", **ex) == 48
    m.scheduler_reset("e:1")  # a new handshake: a fresh scheduler counts from 0
    m.step_done(s, 1, 1, 0.1, _stats(16, 16, 0))
    assert _value(m, "vllm:prefix_cache_queries_total", **ex) == 64
    assert _value(m, "vllm:prefix_cache_hits_total", **ex) == 32
    assert _value(m, "vllm:num_preemptions_total", **ex) == 1


def test_series_rebind_on_a_new_accelerator_and_events_on_no_executor():
    m = EngineMetrics("m")
    unknown = m.series("e:1", "unknown")  # before the first handshake
    m.executor_lost(unknown)
    gpu = m.series("e:1", "gpu")
    assert gpu is not unknown and gpu.accelerator == "gpu"
    m.executor_reconnected(gpu)
    m.failed_over(gpu, 3)
    m.grpc_error(gpu, "UNAVAILABLE")
    assert _value(m, "tandem:executor_lost_total", executor="e:1", accelerator="unknown") == 1
    gpu_labels = {"executor": "e:1", "accelerator": "gpu"}
    assert _value(m, "tandem:executor_reconnects_total", **gpu_labels) == 1
    assert _value(m, "tandem:requests_failed_over_total", **gpu_labels) == 3
    assert _value(m, "tandem:executor_grpc_errors_total", **gpu_labels, code="UNAVAILABLE") == 1
    m.request_finished("abort", RequestStats(arrival=1.0, prompt_tokens=4), None, 3.0)
    none = {"executor": "none", "accelerator": "none"}
    assert _value(m, "vllm:request_success_total", **none, finished_reason="abort") == 1
    assert _value(m, "vllm:request_prompt_tokens_sum", **none) == 4
    assert _value(m, "vllm:request_generation_tokens_count", **none) == 0
    # Nothing is exposed for an executor before its first event.
    assert b'executor="e:2"' not in generate_latest(m.registry)


def test_an_executor_that_leaves_takes_its_series_with_it():
    m = EngineMetrics("m")
    gone, kept = m.series("gone:1", "gpu"), m.series("kept:1", "tpu")
    m.series("gone:1", "cpu")  # another device answered there once: both label sets go
    for s in (gone, kept):
        r = RequestStats(arrival=1.0, prompt_tokens=3)
        m.tokens_generated(s, r, 1, 2.0)
        m.step_done(s, 3, 1, 0.1, _stats(16, 8, 1))
        m.request_finished("stop", r, 1, 2.0, s)
        m.executor_lost(s)
        m.grpc_error(s, "UNAVAILABLE")
    m.remove_executor("gone:1")
    text = generate_latest(m.registry).decode()
    assert 'executor="gone:1"' not in text
    assert text.count('executor="kept:1"') > 20  # every family of the other one stays
    assert _value(m, "tandem:executor_lost_total", executor="kept:1", accelerator="tpu") == 1
    back = m.series("gone:1", "gpu")  # it rejoins: fresh series, from zero
    assert back is not gone
    assert _value(m, "tandem:executor_lost_total", executor="gone:1", accelerator="gpu") == 0
