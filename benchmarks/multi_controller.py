"""Several controllers over one fleet, for the benchmarks: start N controllers that list each
other as peers (they divide the executors, controller/fleet/peers.py), wait until every executor
is driven by exactly one of them, and read the fleet's state and the controllers' CPU across
them. A load generator spreads its requests over `LiveServer.base_url`s round robin, as a load
balancer in front of them would."""

from __future__ import annotations

import os
import sys

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.processes import LiveServer, free_port, spawn_controller, wait_until  # noqa: E402

PEER_ARGS = ["--peer-probe-interval", "0.5"]  # peers found within a second of starting


def start_controllers(
    model: str, tmp: str, args: list[str], count: int, name: str = "controller"
) -> list[LiveServer]:
    """`count` controllers with the same flags, each listing all of them as peers (with one,
    none: a single controller drives everything, as before)."""
    ports = [free_port() for _ in range(count)]
    peers = sum((["--peer", f"127.0.0.1:{p}"] for p in ports), []) if count > 1 else []
    extra = [*PEER_ARGS, *peers] if count > 1 else []
    return [
        spawn_controller(model, tmp, [*args, *extra], f"{name}-{i}", port=port)
        for i, port in enumerate(ports)
    ]


def owned_states(server: LiveServer) -> list[dict]:
    """The executors this controller drives (healthy and under its lease)."""
    execs = httpx.get(server.base_url + "/admin/executors", timeout=10).json()["executors"]
    return [e for e in execs if e["healthy"] and e.get("owned", True)]


def wait_divided(servers: list[LiveServer], executors: int, timeout: float, logs: str) -> None:
    """Until every executor is driven by exactly one controller, and each drives its share."""

    def divided() -> bool:
        try:
            owned = [{e["address"] for e in owned_states(s)} for s in servers]
        except httpx.HTTPError:
            return False
        together = set().union(*owned)
        fair = min(map(len, owned)) >= executors // len(servers)
        return len(together) == sum(map(len, owned)) == executors and fair

    wait_until(divided, timeout, f"{executors} executors divided over {len(servers)}", logs=logs)


def fleet_state_all(servers: list[LiveServer]) -> tuple[int, int, int]:
    """(executors driven, running requests, waiting requests) summed over the controllers."""
    healthy = running = waiting = 0
    for server in servers:
        state = httpx.get(server.base_url + "/admin/executors", timeout=10).json()
        owned = [e for e in state["executors"] if e["healthy"] and e.get("owned", True)]
        healthy += len(owned)
        running += sum(e["running"] for e in owned)
        waiting += sum(e["waiting"] for e in owned) + state.get("requests_waiting_for_executor", 0)
    return healthy, running, waiting


def metric_total(servers: list[LiveServer], name: str) -> float:
    """A counter summed over its series and over the controllers' /metrics."""
    total = 0.0
    for server in servers:
        for line in httpx.get(server.base_url + "/metrics", timeout=10).text.splitlines():
            if line.startswith(name) and (line[len(name)] in " {"):
                total += float(line.rsplit(" ", 1)[1])
    return total


def stop_all(servers: list[LiveServer]) -> None:
    for server in servers:
        server.stop()
