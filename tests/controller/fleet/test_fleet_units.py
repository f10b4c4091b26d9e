"""Fleet pieces without a model: the step-cost model, the placement policy, exact prefix
affinity on a session's block pool, the DNS stub resolver and discovery."""

from __future__ import annotations

import asyncio
import random

import pytest

from common.wire.step_types import SamplingParams
from controller.core.kv_cache import hash_token_blocks
from controller.core.request import Request
from controller.core.scheduler import Scheduler, SchedulerConfig
from controller.fleet import dns
from controller.fleet.discovery import MISSES_TO_LEAVE, Discovery
from controller.fleet.placement import Candidate, PlacementPolicy, PlacementQuery, StepCostModel
from controller.settings import ControllerConfig
from tests.support.dns_server import LocalDNSServer

# --- step-cost model -----------------------------------------------------------------------


def test_cost_model_starts_at_prior_and_learns_the_line():
    m = StepCostModel(prior_overhead=0.05, prior_per_token=0.001)
    assert m.coefficients() == pytest.approx((0.05, 0.001))
    rng = random.Random(0)
    for _ in range(300):
        tokens = rng.choice([1, 2, 4, 8, 64, 256])
        m.observe(tokens, 0.010 + 0.0002 * tokens)
    overhead, per_token = m.coefficients()
    assert overhead == pytest.approx(0.010, rel=0.02)
    assert per_token == pytest.approx(0.0002, rel=0.02)
    assert m.step_seconds(100) == pytest.approx(0.030, rel=0.05)
    assert m.tokens_per_second > 0


def test_cost_model_tokens_within_a_step_time():
    m = StepCostModel(prior_overhead=0.1, prior_per_token=0.001)
    assert m.tokens_within(0.5) == 400  # (0.5 - 0.1) / 0.001
    assert m.tokens_within(0.05) == 0  # the overhead alone is over it
    assert m.step_budget(0.5, full=2048, needed=10) == 400
    assert m.step_budget(0.5, full=300, needed=10) == 300  # never above the configured budget
    assert m.step_budget(0.05, full=2048, needed=10) == 128  # a floor for progress
    assert m.step_budget(0.05, full=2048, needed=257) == 257  # every running decode fits
    assert m.step_budget(0.05, full=64, needed=10) == 64
    for _ in range(200):  # a fast device: 10 ms + 20 us per token
        m.observe(8, 0.010 + 0.00002 * 8)
        m.observe(512, 0.010 + 0.00002 * 512)
    assert m.tokens_within(0.5) == pytest.approx(24500, rel=0.05)


def test_step_budget_of_a_fresh_fast_executor_reaches_the_full_budget_at_once():
    """From the default prior (2 ms a token) a GPU-speed executor starts on short steps and is
    given the whole budget as soon as its first steps are measured; a slow one stays short."""
    fast, slow = StepCostModel(), StepCostModel()
    budgets = {"fast": [], "slow": []}
    for _ in range(6):
        for name, m, per_token in (("fast", fast, 0.00002), ("slow", slow, 0.0012)):
            b = m.step_budget(0.5, full=2048, needed=1)
            budgets[name].append(b)
            m.observe(b, 0.01 + per_token * b)
    assert budgets["fast"][0] < 300 and budgets["fast"][2:] == [2048] * 4
    assert all(300 <= b <= 450 for b in budgets["slow"][2:])  # (0.5 - 0.01) / 1.2 ms = 408


def test_cost_model_follows_a_slowdown_and_ignores_bad_samples():
    m = StepCostModel()
    for _ in range(100):
        m.observe(8, 0.02)
    fast = m.step_seconds(8)
    for _ in range(100):
        m.observe(8, 0.08)
    assert m.step_seconds(8) == pytest.approx(0.08, rel=0.1) and fast < 0.03
    m.observe(0, 1.0)
    m.observe(8, float("nan"))
    assert m.step_seconds(8) == pytest.approx(0.08, rel=0.1)


# --- placement policy ----------------------------------------------------------------------


def cand(key: str, **kw) -> Candidate:
    base = dict(
        key=key,
        prefix_hit=0,
        num_requests=0,
        uncomputed_tokens=0,
        decode_tokens=0,
        max_num_seqs=64,
        max_num_batched_tokens=2048,
        free_blocks=1000,
        block_size=16,
        overhead=0.02,
        per_token=0.001,
    )
    base.update(kw)
    return Candidate(**base)


def test_equal_idle_executors_take_turns():
    policy = PlacementPolicy()
    q = PlacementQuery(num_tokens=40, expected_output=32)
    a, b = cand("a"), cand("b", placed=1)
    assert policy.choose(q, [a, b]).key == "a"
    assert policy.choose(q, [cand("a", placed=3), b]).key == "b"
    assert policy.choose(q, []) is None


def test_affinity_wins_within_the_bound_and_load_beyond_it():
    policy = PlacementPolicy(affinity_max_wait=2.0)
    q = PlacementQuery(num_tokens=300, expected_output=16, reference_batch=2)
    holder = cand("holder", prefix_hit=288, decode_tokens=200, num_requests=4)
    idle = cand("idle")
    d = policy.choose(q, [holder, idle])
    assert (d.key, d.reason, d.prefix_hit) == ("holder", "affinity", 288)
    assert d.latency - d.balance_latency <= 2.0
    # Many decoding requests barely delay this one (they share its steps), but 3000 tokens of
    # prefill queued ahead of it would hold it back ~3 s: past the bound.
    decoding = cand("holder", prefix_hit=288, decode_tokens=2000, num_requests=60)
    assert policy.choose(q, [decoding, idle]).key == "holder"
    busy = cand("holder", prefix_hit=288, uncomputed_tokens=3000, num_requests=10)
    d = policy.choose(q, [busy, idle])
    assert (d.key, d.reason) == ("idle", "load")
    assert d.latency < 1.0
    off = PlacementPolicy(prefix_affinity=False)
    assert off.choose(q, [holder, idle]).key == "idle"


def test_work_is_spread_in_proportion_to_speed():
    """Requests arriving one by one (each adds its expected output to the backlog of the
    executor it goes to): a 3x faster executor ends up with about 3x the work."""
    policy = PlacementPolicy()
    fast = cand("fast", overhead=0.010, per_token=0.0005)
    slow = cand("slow", overhead=0.030, per_token=0.0015)
    counts = {"fast": 0, "slow": 0}
    for _ in range(80):
        total = fast.num_requests + slow.num_requests
        q = PlacementQuery(num_tokens=50, expected_output=64, reference_batch=1 + total / 2)
        chosen = policy.choose(q, [fast, slow])
        c = fast if chosen.key == "fast" else slow
        c.num_requests += 1
        c.decode_tokens += 64
        c.placed += 1
        counts[chosen.key] += 1
    assert 2.3 <= counts["fast"] / counts["slow"] <= 3.9, counts


def test_an_executor_without_free_blocks_is_avoided():
    policy = PlacementPolicy()
    q = PlacementQuery(num_tokens=200, expected_output=64)
    full = cand("full", free_blocks=3)
    roomy = cand("roomy", decode_tokens=40, num_requests=1)
    assert policy.choose(q, [full, roomy]).key == "roomy"


# --- exact prefix affinity on a session -----------------------------------------------------


def _session_with_scheduler():
    from common.wire.config import (
        Capabilities,
        DeviceInfo,
        KVCacheSpec,
        ModelGeometry,
    )
    from controller.fleet.session import ExecutorSession
    from controller.observe.metrics import EngineMetrics

    config = ControllerConfig(model="unused", executors=["127.0.0.1:1"])
    session = ExecutorSession(None, config, EngineMetrics("m"), "127.0.0.1:1")  # no owner needed
    session.info = DeviceInfo(
        "inc",
        "cpu",
        "cpu",
        ModelGeometry("m", "Llama", 100, 1, 1, 1, 4096),
        KVCacheSpec(16, 64, "float32"),
        Capabilities(),
    )
    session.num_blocks = 64
    session.scheduler = Scheduler(SchedulerConfig(block_size=16, num_blocks=64))
    return session


def test_session_prefix_hit_sees_cached_and_queued_blocks_exactly():
    from common.wire.step_types import RequestStepOutput, StepOutput
    from controller.core.outputs import GenerationRequest
    from controller.fleet.tracked import Tracked

    session = _session_with_scheduler()
    prompt = list(range(1, 70))  # 4 full blocks + 5 tokens
    hashes = hash_token_blocks(prompt, 16)
    assert session.prefix_hit(hashes, len(prompt)) == 0
    gen = GenerationRequest("r1", prompt, SamplingParams(), max_tokens=4)
    tracked = Tracked(
        gen=gen,
        queue=asyncio.Queue(),
        text=None,
        request=Request("r1", prompt, SamplingParams(), max_tokens=4),
        arrival=0.0,
        queued_hashes=hashes,
    )
    session.add(tracked)
    # Queued, not scheduled: the pool has nothing yet, but its blocks will be cached before
    # any later request is admitted, so placement already counts them.
    assert session.scheduler.peek_prefix_hit(hashes, len(prompt)) == 0
    assert session.prefix_hit(hashes, len(prompt)) == 64  # at most num_tokens - 1, whole blocks
    other = prompt[:40] + [99] * 30  # shares 2 full blocks, then differs
    assert session.prefix_hit(hash_token_blocks(other, 16), len(other)) == 32
    step = session.scheduler.schedule()
    assert session.scheduler.peek_prefix_hit(hashes, len(prompt)) == 64
    session.scheduler.update_from_output(
        step, StepOutput(step.step_id, [RequestStepOutput("r1", sampled_token_id=5)])
    )
    session.withdraw(tracked)  # gone: its announcement leaves, its computed blocks stay cached
    assert not session.tracked.queued and not session.tracked
    assert session.prefix_hit(hashes, len(prompt)) == 64
    assert session.scheduler.stats().num_used_blocks == 0


# --- DNS stub resolver and discovery --------------------------------------------------------


@pytest.fixture
def dns_server():
    server = LocalDNSServer(truncate_over=3)
    yield server
    server.close()


def test_dns_query_answers_nxdomain_and_tcp_fallback(dns_server):
    ns = ("127.0.0.1", dns_server.port)
    dns_server.set("executors.fleet.test", ["127.0.0.2", "127.0.0.3"])
    assert sorted(dns.query("executors.fleet.test", dns.QTYPE_A, ns)) == ["127.0.0.2", "127.0.0.3"]
    assert dns.query("executors.fleet.test", dns.QTYPE_AAAA, ns) == []
    assert dns.query("nothing.fleet.test", dns.QTYPE_A, ns) == []
    many = [f"127.0.1.{i}" for i in range(1, 9)]  # over the UDP limit: TC, then TCP
    dns_server.set("big.fleet.test", many)
    assert sorted(asyncio.run(dns.resolve("big.fleet.test", ns))) == sorted(many)
    assert asyncio.run(dns.resolve("127.0.0.9", ns)) == ["127.0.0.9"]


def test_dns_errors_are_errors_not_empty_answers():
    from tests.support.processes import free_port

    with pytest.raises(dns.DNSError):
        dns.query("x.test", dns.QTYPE_A, ("127.0.0.1", free_port()), timeout=0.3)


def test_system_resolver_path_resolves_localhost():
    assert "127.0.0.1" in asyncio.run(dns.resolve("localhost"))


def test_discovery_merges_sources_and_keeps_answers_through_failures(dns_server, tmp_path):
    listing = tmp_path / "executors.txt"
    listing.write_text("# the fleet\n127.0.0.5:7000\n\n127.0.0.6:7000  # a comment\n")
    dns_server.set("pods.fleet.test", ["127.0.0.2"])
    cfg = ControllerConfig(
        model="unused",
        executors=["127.0.0.1:7000"],
        executor_dns=["pods.fleet.test:7001"],
        executor_files=[str(listing)],
        dns_server=dns_server.address,
        discovery_interval=1.0,
    )
    disc = Discovery(cfg)
    assert disc.dynamic
    found = asyncio.run(disc.resolve())
    assert found == {
        "127.0.0.1:7000": "static",
        "127.0.0.2:7001": "dns",
        "127.0.0.5:7000": "file",
        "127.0.0.6:7000": "file",
    }
    # A new pod joins, one file entry goes.
    dns_server.set("pods.fleet.test", ["127.0.0.2", "127.0.0.3"])
    listing.write_text("127.0.0.5:7000\n")
    found = asyncio.run(disc.resolve())
    assert "127.0.0.3:7001" in found
    assert "127.0.0.6:7000" in found  # missing once: kept one more round
    for _ in range(MISSES_TO_LEAVE):
        found = asyncio.run(disc.resolve())
    assert "127.0.0.6:7000" not in found
    # The nameserver stops answering and the file vanishes: keep the last answers.
    dns_server.close()
    listing.unlink()
    disc.timeout = 0.3
    found = asyncio.run(disc.resolve())
    assert {"127.0.0.2:7001", "127.0.0.3:7001", "127.0.0.5:7000"} <= set(found)


def test_discovery_rejects_malformed_names():
    with pytest.raises(ValueError):
        Discovery(ControllerConfig(model="unused", executor_dns=["no-port.test"]))
