"""What reads executor snapshots, from snapshots alone (no session, no engine): placement
candidates, the fleet's cost prior, the admin report and the scrape-time fleet collector."""

from __future__ import annotations

import dataclasses

import pytest

from controller.core.snapshot import ExecutorSnapshot
from controller.fleet.placement import (
    PlacementPolicy,
    PlacementQuery,
    candidate_of,
    mean_step_cost,
)
from controller.observe.fleet_collector import FleetCollector
from controller.observe.report import executor_report


def snapshot(address: str = "a:1", **fields) -> ExecutorSnapshot:
    """A connected, healthy, idle executor unless told otherwise."""
    base = dict(
        address=address,
        source="static",
        kind="gpu",
        device="H100",
        incarnation="i1",
        incarnations=1,
        state="healthy",
        healthy=True,
        state_since=100.0,
        connected=True,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        requests=0,
        running=0,
        waiting=0,
        uncomputed_tokens=0,
        decode_tokens=0,
        num_blocks=101,
        block_size=16,
        used_blocks=0,
        kv_usage=0.0,
        overhead=0.01,
        per_token=0.0001,
        tokens_per_second=0.0,
        measured_steps=10,
        steps=10,
        tokens=100,
        requests_placed=0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        losses=0,
        reconnects=0,
        last_loss="",
        connect_error="",
    )
    base.update(fields)
    return ExecutorSnapshot(**base)


def test_snapshots_are_immutable():
    snap = snapshot()
    with pytest.raises(dataclasses.FrozenInstanceError):
        snap.requests = 3  # type: ignore[misc]


def test_placement_candidates_come_from_snapshots():
    busy = snapshot(
        "busy:1",
        requests=5,
        uncomputed_tokens=300,
        decode_tokens=200,
        used_blocks=40,
        requests_placed=9,
        max_num_seqs=32,
        max_num_batched_tokens=512,
        overhead=0.02,
        per_token=0.0003,
    )
    c = candidate_of(busy, prefix_hit=48)
    assert (c.key, c.prefix_hit, c.num_requests, c.uncomputed_tokens, c.decode_tokens) == (
        "busy:1",
        48,
        5,
        300,
        200,
    )
    assert (c.max_num_seqs, c.max_num_batched_tokens, c.free_blocks, c.block_size) == (
        32,
        512,
        60,
        16,
    )
    assert (c.overhead, c.per_token, c.placed) == (0.02, 0.0003, 9)

    policy = PlacementPolicy(prefix_affinity=True, affinity_max_wait=2.0)
    q = PlacementQuery(num_tokens=100, expected_output=32)
    idle = snapshot("idle:1")
    assert policy.choose(q, [candidate_of(busy, 0), candidate_of(idle, 0)]).key == "idle:1"
    # The busy one holds the prompt cached and is within the bound: affinity.
    decision = policy.choose(q, [candidate_of(busy, 96), candidate_of(idle, 0)])
    assert (decision.key, decision.reason, decision.prefix_hit) == ("busy:1", "affinity", 96)


def test_a_new_executors_cost_prior_is_the_measured_fleets_mean():
    measured = [snapshot(overhead=0.01, per_token=0.001), snapshot(overhead=0.03, per_token=0.003)]
    unmeasured = snapshot(overhead=9.0, per_token=9.0, measured_steps=0)
    assert mean_step_cost(measured + [unmeasured]) == pytest.approx((0.02, 0.002))
    assert mean_step_cost([unmeasured]) is None


def test_admin_report_is_a_function_of_a_snapshot():
    snap = snapshot(
        state="draining",
        healthy=False,
        state_since=90.0,
        requests=3,
        running=2,
        waiting=1,
        uncomputed_tokens=70,
        used_blocks=25,
        kv_usage=0.25,
        overhead=0.0123456,
        per_token=0.000123456,
        tokens_per_second=1234.56,
        requests_placed=7,
        prefix_cache_queries=500,
        prefix_cache_hits=320,
        losses=2,
        reconnects=1,
        last_loss="stream broke",
        owned=True,
        owner="host/abc",
        assigned_to="10.0.0.2:8000",
        step_transport="socket",
    )
    assert executor_report(snap, now=100.0) == {
        "address": "a:1",
        "source": "static",
        "state": "draining",
        "healthy": False,
        "state_seconds": 10.0,
        "kind": "gpu",
        "device": "H100",
        "incarnation": "i1",
        "incarnations": 1,
        "tensor_parallel_size": 1,
        "num_blocks": 101,
        "block_size": 16,
        "max_num_batched_tokens": 2048,
        "requests": 3,
        "running": 2,
        "waiting": 1,
        "uncomputed_tokens": 70,
        "kv_usage": 0.25,
        "used_blocks": 25,
        "step_overhead_ms": 12.346,
        "per_token_ms": 0.1235,
        "tokens_per_second": 1234.6,
        "steps": 10,
        "tokens": 100,
        "step_transport": "socket",
        "requests_placed": 7,
        "prefix_cache_queries": 500,
        "prefix_cache_hits": 320,
        "losses": 2,
        "reconnects": 1,
        "last_loss": "stream broke",
        "connect_error": "",
        "duplicate_of": "",
        "owned": True,
        "owner": "host/abc",
        "assigned_to": "10.0.0.2:8000",
    }
    before = snapshot(kind=None, device=None, incarnation=None, state="connecting")
    report = executor_report(before)
    assert (report["kind"], report["device"], report["incarnation"]) == (None, None, None)
    assert report["state_seconds"] > 0  # against time.monotonic() by default


def test_fleet_collector_reads_snapshots_without_an_engine():
    fleet = [
        snapshot("g:1", running=3, waiting=1, used_blocks=30, kv_usage=0.3),
        snapshot("t:1", kind="tpu", running=1, waiting=0, used_blocks=10, num_blocks=51),
        snapshot("c:1", kind="cpu", state="unhealthy", healthy=False, connected=False),
        snapshot("n:1", kind=None, state="connecting", healthy=False, connected=False),
    ]
    collector = FleetCollector(lambda: (fleet, 2), "m", True)
    got = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }

    def value(name: str, **labels) -> float:
        return got[(name, tuple(sorted({"model_name": "m", **labels}.items())))]

    assert value("vllm:num_requests_running") == 4
    assert value("vllm:num_requests_waiting") == 1 + 2  # queued on executors + for one
    assert value("tandem:requests_waiting_for_executor") == 2
    assert value("vllm:kv_cache_usage_perc") == pytest.approx(40 / 150)
    gpu = {"executor": "g:1", "accelerator": "gpu"}
    assert value("tandem:executor_requests_running", **gpu) == 3
    assert value("tandem:executor_requests_waiting", **gpu) == 1
    assert value("tandem:executor_kv_cache_usage_perc", **gpu) == 0.3
    assert value("tandem:executor_kv_blocks", **gpu, state="total") == 100
    assert value("tandem:executor_kv_blocks", **gpu, state="used") == 30
    info = dict(gpu, block_size="16", num_gpu_blocks="101", enable_prefix_caching="True")
    assert value("vllm:cache_config_info", **info) == 1.0
    assert value("tandem:executor_healthy", **gpu) == 1.0
    assert value("tandem:executor_healthy", executor="c:1", accelerator="cpu") == 0.0
    assert value("tandem:executor_healthy", executor="n:1", accelerator="unknown") == 0.0
    # Not connected: health only, no load series.
    assert not [k for k in got if ("executor", "c:1") in k[1] and "running" in k[0]]
    assert value("tandem:executors", accelerator="gpu", state="healthy") == 1
    assert value("tandem:executors", accelerator="cpu", state="unhealthy") == 1
    assert value("tandem:executors", accelerator="unknown", state="connecting") == 1
    assert value("tandem:executors", accelerator="tpu", state="draining") == 0
