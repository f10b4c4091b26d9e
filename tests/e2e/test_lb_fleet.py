"""Two controllers behind a real haproxy (the config `make fleet CONTROLLERS=2` uses), under
closed-loop clients through haproxy, streamed and not:

- a rolling restart of each controller in turn (SIGTERM, then started again on its port), over
  two real CPU executors (the model's greedy texts) and over four simulated ones (the scale): no
  request fails, every greedy text is the one the fleet gave before the restarts, and no KV
  block stays in use;
- kill -9 of one controller, over four simulated executors: the other claims its executors
  within the lease plus a handshake; haproxy marks it DOWN within its health checks; a new
  request succeeds at once (haproxy retries a refused connection on the other controller); a
  non-streamed request that was running on the killed controller is replayed by haproxy on the
  other one (the client gets its 200 and the same text); a stream that was running there ends
  without [DONE] after a prefix of its text (the connection is cut), and nothing else fails.

The measured times are printed (pytest -s) for docs/operations.md.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from tandem import balancer
from tests.e2e.lb_support import (
    LEASE,
    PROBE,
    ClosedLoop,
    openai_sender,
    owned,
    raw_sender,
    start_lb_fleet,
)
from tests.e2e.test_serve_command import group_members
from tests.support.balancer import LiveBalancer, require_haproxy
from tests.support.processes import free_port, spawn_executor, spawn_serve, wait_until

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "To make a cup of tea, first",
    "The largest planet in our solar system is",
]
SLACK = 10.0  # handshakes and a loaded 2-core machine's scheduling
SIM_SLOW = ["--step-fixed-ms", "20", "--step-per-token-us", "5"]  # 60 tokens: about 1.2 s
# The rolling restart's fleets: (executor module, how many, their flags, tokens per request).
# Real CPU executors hold the greedy texts to the model's; simulated ones give the scale (their
# greedy tokens are a function of the prompt and position, the same on any executor).
FLEETS = {"cpu": ("executor_gpu", 2, [], 12), "sim": ("executor_sim", 4, SIM_SLOW, 40)}


def assert_no_blocks_in_use(fleet) -> None:
    """Once idle, every executor's KV blocks are free in the pool of the controller that
    drives it (prefix-cached free blocks may stay)."""
    for server in fleet.controllers.values():
        state = server.wait_idle(60)
        for e in state:
            if e["owned"]:
                assert e["used_blocks"] == 0, e


def stop_processes(processes) -> None:
    """SIGTERM, then SIGKILL what still runs after 30 s (the executors' stop is not what
    these tests check)."""
    for proc in processes:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    for proc in processes:
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize("kind", [pytest.param("cpu", marks=pytest.mark.slow), "sim"])
def test_rolling_restart_of_each_controller_loses_nothing(default_model_dir, tmp_path, kind):
    tmp = str(tmp_path)
    module, count, flags, tokens = FLEETS[kind]
    executors = [
        spawn_executor(module, default_model_dir, tmp, f"{kind}{i}", extra=flags)
        for i in range(count)
    ]
    fleet = start_lb_fleet(default_model_dir, tmp, [f"127.0.0.1:{p}" for _, p in executors])
    try:
        model = fleet.controllers["c0"].model_name
        send = openai_sender(fleet.base_url, model, PROMPTS, max_tokens=tokens)
        references = [send(i, False, {}, 0) for i in range(len(PROMPTS))]
        assert all(r.ok for r in references), references
        timings = []
        with ClosedLoop(send, len(PROMPTS), threads=4) as load:
            wait_until(lambda: load.ok_count() >= 4, 120, "load going", logs=tmp)
            for name in ("c0", "c1"):
                timings.append(restart(fleet, name, load, tmp))
        bad = [o for o in load.outcomes if not o.ok]
        assert bad == [], bad[:5]
        assert {o.streamed for o in load.outcomes} == {True, False}
        for o in load.outcomes:
            assert o.text == references[o.prompt].text, o
        assert_no_blocks_in_use(fleet)
        print(
            f"\nrolling restart ({count} {kind} executors) under {len(load.outcomes)} requests, "
            f"0 failed, haproxy retries "
            f"{retries(fleet.balancer)}: "
            + "; ".join(
                f"{n}: exited {stop:.1f}s after SIGTERM, serving again {back:.1f}s after its start"
                for n, stop, back in timings
            )
        )
    finally:
        fleet.stop()
        stop_processes([p for p, _ in executors])


def restart(fleet, name: str, load: ClosedLoop, tmp: str) -> tuple[str, float, float]:
    """SIGTERM controller ``name`` (it drains, then releases its executors), start it again
    on its port, wait until haproxy sees it UP, the split is even again and the load went on;
    (name, seconds to exit, seconds from its start to serving)."""
    process = fleet.controllers[name].controller
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    stopped = time.monotonic() - signalled
    fleet.spawn(name)
    started = time.monotonic()
    wait_until(fleet.serving, 300, f"{name} serving again", logs=tmp)
    back = time.monotonic() - started
    served = load.ok_count()
    wait_until(lambda: load.ok_count() >= served + 4, 120, "load going on", logs=tmp)
    return name, stopped, back


TOKEN_PROMPTS = [[10 + i, 200 + i, 3000 + i, 40 + i, 5 + i] for i in range(8)]
TOKENS = 60


def retries(balancer: LiveBalancer) -> int:
    """Requests haproxy retried or sent to another controller (backend wretr + wredis)."""
    rows = [r for r in balancer.stats() if r["svname"] == "BACKEND"]
    return sum(int(r["wretr"] or 0) + int(r["wredis"] or 0) for r in rows)


def test_kill_9_of_a_controller_through_haproxy(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=SIM_SLOW)
        for i in range(4)
    ]
    fleet = start_lb_fleet(default_model_dir, tmp, [f"127.0.0.1:{p}" for _, p in sims])
    victim, survivor = "c0", "c1"
    try:
        assert sorted(map(len, fleet.split())) == [2, 2]
        model = fleet.controllers[victim].model_name
        send = raw_sender(fleet.base_url, model, TOKEN_PROMPTS, TOKENS)
        references = [send(i, False, {}, 0).text for i in range(len(TOKEN_PROMPTS))]
        assert all(references), references
        with ClosedLoop(send, len(TOKEN_PROMPTS), threads=6) as load:
            wait_until(lambda: load.ok_count() >= 6, 60, "load going", logs=tmp)
            wait_until(lambda: busy(fleet, load, victim), 60, "streams and more on the victim")
            fleet.controllers[victim].controller.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            probe = raw_sender(fleet.base_url, model, TOKEN_PROMPTS, 2)  # short: answers fast
            times = after_kill(fleet, probe, victim, survivor, killed, tmp)
            served = load.ok_count()
            wait_until(lambda: load.ok_count() >= served + 6, 60, "load on the survivor")
        check_outcomes(load, references, victim, survivor, killed)
        assert retries(fleet.balancer) > 0  # haproxy replayed requests on the survivor
        assert_no_blocks_in_use_of(fleet.controllers[survivor])
        print(
            f"\nkill -9 of a controller with 2 of 4 executors: first new request answered "
            f"{times['first_ok']:.2f}s after the kill, haproxy marked it DOWN after "
            f"{times['down']:.2f}s, the other controller drove all 4 executors after "
            f"{times['takeover']:.2f}s (lease {LEASE:g}s, probes {PROBE:g}s); "
            f"{len(load.outcomes)} requests, haproxy retries {retries(fleet.balancer)}"
        )
    finally:
        fleet.stop()
        stop_processes([p for p, _ in sims])


def busy(fleet, load: ClosedLoop, victim: str) -> bool:
    """A stream runs on the victim (its first text arrived), and more requests run there than
    such streams (a non-streamed one, most likely)."""
    streams = [o for o in list(load.open.values()) if o.streamed and o.controller == victim]
    streams = [o for o in streams if o.text]
    state = fleet.controllers[victim].executors_state()
    running = sum(e["running"] for e in state if e["owned"])
    return bool(streams) and running > len(streams)


def after_kill(fleet, send, victim: str, survivor: str, killed: float, tmp: str) -> dict:
    """Seconds from the kill until haproxy marks the victim DOWN (watched in a thread), until
    a new request succeeds, and until the survivor drives every executor."""
    times = {}

    def watch_down() -> None:
        wait_until(lambda: fleet.balancer.states()[victim] == "DOWN", 30, "DOWN", interval=0.05)
        times["down"] = time.monotonic() - killed

    watcher = threading.Thread(target=watch_down)
    watcher.start()
    wait_until(lambda: send(0, False, {}, 0).ok, 30, "a new request to succeed", interval=0.05)
    times["first_ok"] = time.monotonic() - killed
    total = len(fleet.executors)
    limit = LEASE + 3 * PROBE + LEASE / 3 + SLACK
    server = fleet.controllers[survivor]
    wait_until(lambda: len(owned(server)) == total, limit, "takeover", logs=tmp, interval=0.1)
    times["takeover"] = time.monotonic() - killed
    watcher.join(timeout=60)
    assert times["down"] <= 2 * 1.0 + 1.0 + SLACK  # fall 2 x inter 1 s, a check's timeout
    return times


def check_outcomes(load: ClosedLoop, references, victim: str, survivor: str, killed: float):
    """Only streams running on the killed controller failed, each cut after a prefix of its
    text without [DONE]; every other request (non-streamed ones that ran there included:
    replayed) got its whole, identical text."""
    cut = [
        o
        for o in load.outcomes
        if o.streamed and o.controller == victim and o.started < killed < o.ended
    ]
    assert cut, "no stream was running on the killed controller"
    for o in cut:
        # haproxy cuts the client's connection without the chunked body's last chunk.
        assert not o.done and o.status == 200 and o.error == "RemoteProtocolError", o
        assert references[o.prompt].startswith(o.text) and o.text != references[o.prompt], o
    others = [o for o in load.outcomes if o not in cut]
    bad = [o for o in others if not o.ok or o.text != references[o.prompt]]
    assert bad == [], bad[:5]
    assert any(not o.streamed and o.started < killed < o.ended for o in others)
    assert {o.controller for o in others if o.started > killed} == {survivor}


def assert_no_blocks_in_use_of(server) -> None:
    for e in server.wait_idle(60):
        if e["owned"]:
            assert e["used_blocks"] == 0, e


def test_serve_starts_two_controllers_behind_haproxy(default_model_dir, tmp_path):
    """`tandem serve --controllers 2` (what `make fleet CONTROLLERS=2` runs, here over one
    simulated executor): haproxy answers on --port, the controllers see each other, the one
    with the executor serves and the other is DOWN (no executor of its own); SIGTERM stops
    every child and serve exits 0."""
    require_haproxy()
    port, controllers = free_port(), free_port()
    run_dir = tmp_path / "run"
    argv = ["--executor", "sim", "--controllers", "2", "--port", str(port)]
    argv += ["--controller-port", str(controllers), "--executor-port", str(free_port())]
    argv += ["--executor-step-port", str(free_port())]
    argv += ["--run-dir", str(run_dir), "--model", default_model_dir]
    serve = spawn_serve(argv, str(tmp_path / "serve.log"))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/health", timeout=2).status_code == 200, 120, "serve")
        socket_path = balancer.stats_socket(str(run_dir))
        urls = [f"http://127.0.0.1:{controllers + i}" for i in range(2)]

        def settled():
            """Both see each other, agree on the division (the executor's other controller
            shows it assigned elsewhere: the hand-over of a first come, first served start is
            over), and haproxy has the one that drives it UP, the other DOWN (none of its
            own)."""
            peers = [httpx.get(f"{url}/peer", timeout=5).json() for url in urls]
            sessions = [httpx.get(f"{url}/admin/executors", timeout=5).json() for url in urls]
            kinds = [s["executors"][0]["state"] for s in sessions]
            live = all(p["live_controllers"] == 2 for p in peers)
            agreed = sorted(kinds) == ["assigned_elsewhere", "healthy"]
            expected = {
                f"controller{i}": "UP" if k == "healthy" else "DOWN" for i, k in enumerate(kinds)
            }
            states = balancer.server_states(socket_path)
            return states if live and agreed and states == expected else None

        states = wait_until(settled, 60, "the controllers to settle", logs=str(tmp_path))
        for url in urls:
            assert httpx.get(f"{url}/peer", timeout=5).json()["address"] == url[len("http://") :]
        model = os.path.basename(default_model_dir.rstrip("/"))
        resp = httpx.post(base + "/v1/completions", json=greedy_body(model), timeout=60)
        assert resp.status_code == 200, resp.text
        up = [name for name, state in states.items() if state == "UP"]
        assert resp.headers["x-tandem-controller"] == up[0]
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=120) == 0
        wait_until(lambda: group_members(serve.pid) == [], 15, "every child gone")
    finally:
        if serve.poll() is None:
            os.killpg(serve.pid, signal.SIGKILL)
            serve.wait()


def greedy_body(model: str) -> dict:
    return {"model": model, "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
