"""Prefix-cache hit rate across controllers: the same workload with 1 controller, 2 controllers
without cross-controller affinity (--no-peer-affinity) and 2 with it, over simulated executors.

The workload: `--groups` groups of `--group-size` completions each; a group's prompts share a
`--prefix-len`-token prefix and differ in a `--suffix-len`-token suffix. Requests are sent in
rounds (every group's first request, then every group's second, ...), `--concurrency` at a time,
to the controllers in turn as a round-robin load balancer would. The fleet-wide hit rate is
vllm:prefix_cache_hits / vllm:prefix_cache_queries summed over the controllers. A second phase
sends `--hot-requests` requests that all share one `--prefix-len`-token system prompt (distinct
suffixes), `--hot-concurrency` at a time: the share each controller ran shows that a hot
prefix does not pile onto one. Also reported: controller CPU per request (all controllers' CPU
/ requests: what the forwarding hop costs) and mean latency.

    python benchmarks/prefix_affinity.py --json prefix.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.controlplane import cpu_seconds  # noqa: E402
from benchmarks.multi_controller import (  # noqa: E402
    metric_total,
    start_controllers,
    stop_all,
    wait_divided,
)
from tests.support.processes import LiveServer, model_dir, spawn_executor  # noqa: E402

HITS, QUERIES = "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"
SERVED = "vllm:request_success_total"
FORWARDED = 'tandem:peer_affinity_requests_total{outcome="forwarded"}'
CONFIGS = (  # (name, controllers, extra controller flags)
    ("1 controller", 1, []),
    ("2 controllers, no peer affinity", 2, ["--no-peer-affinity"]),
    ("2 controllers, peer affinity", 2, []),
)


@dataclass
class ConfigResult:
    """What one configuration measured."""

    name: str  # the configuration
    controllers: int  # controllers behind the round robin
    requests: int  # group requests sent (all succeeded, else the run fails)
    hit_rate: float  # fleet-wide prefix hits / queries over the group phase
    forwarded: int  # requests forwarded to their home controller (group phase)
    cpu_ms_per_request: float  # all controllers' CPU milliseconds per group request
    mean_latency_ms: float  # mean end-to-end latency of a group request
    hot_hit_rate: float  # hits / queries over the hot-prefix phase
    hot_shares: list[float]  # share of the hot-prefix requests each controller ran


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 40000) for _ in range(n)]


def group_prompts(a: argparse.Namespace) -> list[list[int]]:
    """Every group's requests, in rounds (each group's first, then each group's second...)."""
    rng = random.Random(1)
    prefixes = [tokens(rng, a.prefix_len) for _ in range(a.groups)]
    return [p + tokens(rng, a.suffix_len) for _ in range(a.group_size) for p in prefixes]


def hot_prompts(a: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(2)
    system = tokens(rng, a.prefix_len)
    return [system + tokens(rng, a.suffix_len) for _ in range(a.hot_requests)]


async def send_all(
    a: argparse.Namespace, servers: list[LiveServer], prompts: list[list[int]], concurrency: int
) -> list[float]:
    """Send the prompts in order, `concurrency` at a time, to the controllers in turn; the
    latency of each (all must succeed)."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2)
    async with httpx.AsyncClient(timeout=120, limits=limits) as client:

        async def one(i: int, prompt: list[int]) -> float:
            server = servers[i % len(servers)]
            body = {"model": server.model_name, "prompt": prompt, "max_tokens": a.output_len}
            body |= {"temperature": 0, "ignore_eos": True}
            async with gate:
                started = time.perf_counter()
                resp = await client.post(server.base_url + "/v1/completions", json=body)
                resp.raise_for_status()
                return time.perf_counter() - started

        tasks = []
        for i, prompt in enumerate(prompts):
            await gate.acquire()  # keep the sending order: start i only when a slot is free
            gate.release()
            tasks.append(asyncio.create_task(one(i, prompt)))
            await asyncio.sleep(0)
        return await asyncio.gather(*tasks)


def run_config(a: argparse.Namespace, tmp: str, name: str, count: int, extra: list[str]):
    """Fresh simulated executors and `count` controllers; both phases; everything stopped."""
    sims = [
        spawn_executor("executor_sim", a.model, tmp, f"{count}{extra}-sim{i}", extra=a.sim_args)
        for i in range(a.executors)
    ]
    args = [f"--executor=127.0.0.1:{port}" for _, port in sims]
    args += ["--num-kv-blocks", "4096", "--log-level", "WARNING", *a.controller_args, *extra]
    servers = start_controllers(a.model, tmp, args, count, name.replace(" ", "_").replace(",", ""))
    try:
        wait_divided(servers, a.executors, 180, tmp)
        time.sleep(2.0)  # every controller sees every peer live (3 probe periods)
        prompts = group_prompts(a)
        before = totals(servers)
        latencies = asyncio.run(send_all(a, servers, prompts, a.concurrency))
        after = totals(servers)
        served = [metric_total([s], SERVED) for s in servers]
        hot_before = totals(servers)
        asyncio.run(send_all(a, servers, hot_prompts(a), a.hot_concurrency))
        hot_after = totals(servers)
        hot = [metric_total([s], SERVED) - n for s, n in zip(servers, served, strict=True)]
    finally:
        stop_all(servers)
        for proc, _ in sims:
            proc.kill()
            proc.wait()
    d = {k: after[k] - before[k] for k in before}
    hd = {k: hot_after[k] - hot_before[k] for k in hot_before}
    return ConfigResult(
        name=name,
        controllers=count,
        requests=len(prompts),
        hit_rate=d["hits"] / max(d["queries"], 1.0),
        forwarded=int(d["forwarded"]),
        cpu_ms_per_request=1e3 * d["cpu"] / len(prompts),
        mean_latency_ms=1e3 * sum(latencies) / len(latencies),
        hot_hit_rate=hd["hits"] / max(hd["queries"], 1.0),
        hot_shares=[n / max(sum(hot), 1.0) for n in hot],
    )


def totals(servers: list[LiveServer]) -> dict[str, float]:
    """The counters this benchmark reads, summed over the controllers, and their CPU."""
    return {
        "hits": metric_total(servers, HITS),
        "queries": metric_total(servers, QUERIES),
        "forwarded": metric_total(servers, FORWARDED),
        "cpu": sum(cpu_seconds(s.controller.pid) for s in servers),
    }


def format_table(results: list[ConfigResult]) -> str:
    one = results[0].hit_rate or 1e-9
    rows = [
        f"{'configuration':<32} {'hit%':>6} {'x 1 ctl':>7} {'forwarded':>9} "
        f"{'cpu_ms/req':>10} {'lat_ms':>7} {'hot hit%':>8} {'hot shares':>12}"
    ]
    for r in results:
        shares = "/".join(f"{100 * s:.0f}" for s in r.hot_shares)
        rows.append(
            f"{r.name:<32} {100 * r.hit_rate:>6.1f} {r.hit_rate / one:>7.2f} {r.forwarded:>9} "
            f"{r.cpu_ms_per_request:>10.2f} {r.mean_latency_ms:>7.0f} "
            f"{100 * r.hot_hit_rate:>8.1f} {shares:>12}"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_dir(), help="HF model dir (tokenizer, geometry)")
    p.add_argument("--executors", type=int, default=4, help="simulated executors")
    p.add_argument("--groups", type=int, default=25, help="prefix groups (odd: see README)")
    p.add_argument("--group-size", type=int, default=4, help="requests per group")
    p.add_argument("--prefix-len", type=int, default=512, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=32, help="distinct suffix tokens")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight")
    p.add_argument("--hot-requests", type=int, default=128, help="requests of the hot phase")
    p.add_argument("--hot-concurrency", type=int, default=32, help="in flight, hot phase")
    p.add_argument(
        "--sim-args",
        default="--step-fixed-ms 2 --step-per-token-us 5",
        type=str.split,
        help="simulated executor flags",
    )
    p.add_argument(
        "--controller-args", default="", type=str.split, help="extra flags for every controller"
    )
    p.add_argument("--log-dir", default="", help="keep process logs here (default: temporary)")
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.log_dir or scratch
        os.makedirs(tmp, exist_ok=True)
        for name, count, extra in CONFIGS:
            results.append(run_config(a, tmp, name, count, extra))
            print(format_table(results[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    print(format_table(results))
    if a.json:
        config = {k: v for k, v in vars(a).items() if k not in ("json", "log_dir")}
        with open(a.json, "w") as f:
            json.dump({"config": config, "results": [asdict(r) for r in results]}, f, indent=2)


if __name__ == "__main__":
    main()
