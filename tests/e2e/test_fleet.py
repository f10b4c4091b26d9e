"""Two executors of different kinds behind one controller: placement by cached prefix, load
and speed, and the fleet as /v1/models, /health and the admin endpoint show it.

The second executor is executor_tpu (XLA on the CPU) when this checkout has it, else a second
executor_gpu (on the CPU: the "cpu" kind).
"""

from __future__ import annotations

import asyncio
import importlib.util
import random

import httpx
import pytest

from tests.e2e.helpers import assert_no_blocks_in_use
from tests.support.processes import executor_module_available, start_server, wait_healthy_executors

SECOND = (
    "executor_tpu"
    if executor_module_available("executor_tpu") and importlib.util.find_spec("torch_xla")
    else "executor_gpu"
)
KINDS = ("executor_gpu", SECOND)
# Small steps keep a static-shape executor's compiled buckets few (and cheap on XLA:CPU).
CONTROLLER_ARGS = ["--executor-limits", "tpu=64,8"]
WORDS = ["red", "blue", "green", "old", "young", "tall", "small", "big", "slow", "quick"]


@pytest.fixture(scope="module")
def fleet(default_model_dir, tmp_path_factory):
    s = start_server(
        default_model_dir,
        str(tmp_path_factory.mktemp("fleet")),
        controller_args=CONTROLLER_ARGS,
        executor_kinds=KINDS,
        timeout=900,
    )
    wait_healthy_executors(s, 2, timeout=900)
    # A few requests of each shape first, so that both step-cost models are measured.
    run_concurrently(
        s, [f"Warm-up {i}: " + "tell me more " * (1 + 8 * (i % 2)) for i in range(8)], 12
    )
    yield s
    s.stop()


def shared_prefix_prompts(groups: int = 4, per_group: int = 5) -> list[str]:
    """`groups` documents of ~130 tokens, each followed by `per_group` different questions;
    a fresh nonce so that no earlier request shares a prefix. Shuffled."""
    nonce = random.randrange(10**5, 10**6)
    docs = [
        f"Document {nonce}-{g}: "
        + " ".join(f"fact {g}.{i} is that the {w} cat sat." for i, w in enumerate(WORDS))
        for g in range(groups)
    ]
    prompts = [f"{d} Question {k}: what is fact {k}?" for d in docs for k in range(per_group)]
    random.Random(nonce).shuffle(prompts)
    return prompts


def run_concurrently(server, prompts: list[str], max_tokens) -> list:
    """Greedy completions of all prompts at once; max_tokens is an int or one per prompt."""
    limits = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)

    async def run():
        async with server.async_client() as client:
            return await asyncio.gather(
                *(
                    client.completions.create(
                        model=server.model_name,
                        prompt=p,
                        max_tokens=n,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for p, n in zip(prompts, limits)
                )
            )

    return asyncio.run(run())


def hit_rate(responses) -> float:
    prompt = sum(r.usage.prompt_tokens for r in responses)
    cached = sum(r.usage.prompt_tokens_details.cached_tokens for r in responses)
    return cached / prompt


def placed(server) -> dict[str, int]:
    return {e["address"]: e["requests_placed"] for e in server.executors_state()}


def compare_hit_rates(fleet, single) -> tuple[float, float, dict[str, int]]:
    """Run one shared-prefix workload on the fleet and on a single executor; return both hit
    rates and the fleet's placements per executor. Greedy text must not depend on where."""
    prompts = shared_prefix_prompts()
    before = placed(fleet)
    fleet_responses = run_concurrently(fleet, prompts, 4)
    single_responses = run_concurrently(single, prompts, 4)
    after = placed(fleet)
    assert [r.choices[0].text for r in fleet_responses] == [
        r.choices[0].text for r in single_responses
    ]
    assert_no_blocks_in_use(fleet)
    return (
        hit_rate(fleet_responses),
        hit_rate(single_responses),
        {a: after[a] - before[a] for a in after},
    )


@pytest.mark.slow
def test_shared_prefixes_land_where_they_are_cached(fleet, server):
    """Mixed kinds: the fleet's prefix hit rate stays close to one executor's on the same
    workload (each document's requests follow its cached prefix, within the bound)."""
    fleet_rate, single_rate, share = compare_hit_rates(fleet, server)
    kinds = {e["address"]: e["kind"] for e in fleet.executors_state()}
    print(
        f"\nFLEET prefix hit rate ({'+'.join(kinds.values())}): fleet {fleet_rate:.3f}, "
        f"single executor {single_rate:.3f}, placements {share}"
    )
    assert single_rate > 0.5
    assert fleet_rate >= single_rate - 0.1  # close: a loaded machine shifts a few requests


@pytest.mark.slow
def test_shared_prefixes_on_two_equal_executors(executor_pair, server):
    """Two executors of equal speed share the work, and still hit the cache about as often
    as a single executor: the requests of one document go where its prefix is."""
    wait_healthy_executors(executor_pair, 2)
    fleet_rate, single_rate, share = compare_hit_rates(executor_pair, server)
    print(
        f"\nFLEET prefix hit rate (cpu+cpu): fleet {fleet_rate:.3f}, single executor "
        f"{single_rate:.3f}, placements {share}"
    )
    assert fleet_rate >= single_rate - 0.1  # close: a loaded machine shifts a few requests
    assert all(n >= 4 for n in share.values()), share  # at least about a document each


@pytest.mark.slow
def test_mixed_workload_is_spread_by_speed(fleet):
    """Distinct prompts of mixed lengths: both executors take work, and the one measured
    faster takes at least about as much as the slower one."""
    rng = random.Random(1)
    prompts = [f"Story {i}: " + "once upon a time " * rng.randint(1, 12) for i in range(24)]
    limits = [rng.choice([16, 24, 32]) for _ in prompts]
    run_concurrently(fleet, prompts[:4], 8)  # warm the step-cost models up
    before = placed(fleet)
    run_concurrently(fleet, prompts, limits)
    after = placed(fleet)
    state = {e["address"]: e for e in fleet.executors_state()}

    def seconds_per_token(e, batch=6.0):  # decode cost at a common batch (the model's fit)
        return e["step_overhead_ms"] / batch + e["per_token_ms"]

    share = {a: after[a] - before[a] for a in after}
    speed = {a: 1 / seconds_per_token(state[a]) for a in state}
    print(
        f"\nFLEET mixed workload: requests {share}, relative speed "
        f"{ {a: round(s / max(speed.values()), 2) for a, s in speed.items()} }, kinds "
        f"{ {a: state[a]['kind'] for a in state} }"
    )
    assert all(n > 0 for n in share.values()), share
    fast, slow = sorted(state, key=lambda a: -speed[a])
    if speed[fast] >= 1.5 * speed[slow]:
        assert share[fast] > share[slow], (share, speed)
    else:
        assert share[fast] >= 0.6 * share[slow], (share, speed)
    assert_no_blocks_in_use(fleet)


@pytest.mark.slow
def test_models_health_and_admin_show_the_fleet(fleet):
    base = fleet.base_url
    (model,) = httpx.get(base + "/v1/models").json()["data"]
    assert model["executors"]["total"] == 2 and model["executors"]["healthy"] == 2
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json() == {"status": "ok"}
    details = httpx.get(base + "/admin/health")  # from loopback: no admin key needed
    assert details.status_code == 200 and details.json()["healthy_executors"] == 2
    admin = httpx.get(base + "/admin/executors").json()
    assert admin["requests_waiting_for_executor"] == 0
    for e in admin["executors"]:
        for key in (
            "address",
            "kind",
            "state",
            "healthy",
            "incarnation",
            "running",
            "waiting",
            "kv_usage",
            "used_blocks",
            "requests",
            "step_overhead_ms",
            "per_token_ms",
            "requests_placed",
            "prefix_cache_hits",
            "losses",
            "reconnects",
        ):
            assert key in e, key
        assert e["state"] == "healthy" and e["incarnation"] and e["num_blocks"] > 1
    kinds = {e["kind"] for e in admin["executors"]}
    assert len(kinds) == (2 if SECOND == "executor_tpu" else 1), kinds
    metrics = httpx.get(base + "/metrics").text
    assert 'tandem:executors{accelerator="tpu",model_name="' in metrics
    assert "tandem:placements_total" in metrics
