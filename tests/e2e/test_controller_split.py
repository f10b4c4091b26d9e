"""Controllers divide the executors between them, with real processes: four simulated
executors, controllers that list each other as peers (--peer). Two controllers split the
executors 2/2 and both serve; a third joins under steady load and the executors rebalance (each
controller ends with 1 or 2, no request fails, no block leaks); one controller SIGKILLed, the
others claim its executors within the lease plus the peer window. The times are printed
(pytest -s) for the report."""

from __future__ import annotations

import signal
import threading
import time

import httpx

from tests.e2e.adversarial.isolation_support import SIM_SPEED, complete, greedy
from tests.e2e.lb_support import CONTROLLER_ARGS as SPLIT
from tests.e2e.lb_support import LEASE, PROBE, owned
from tests.support.processes import (
    free_port,
    spawn_controller,
    spawn_executor,
    wait_until,
)

TOKENS = 160  # per request under load: long enough that hand-overs find requests running
SLACK = 10.0  # handshakes and a loaded 2-core machine's scheduling


def split_of(servers, least: int = 0, total: int = 4) -> list[set[str]] | None:
    """Each controller's executors, once together they drive all `total`, each exactly once,
    and each at least `least` of them."""
    sets = [owned(s) for s in servers]
    together = set().union(*sets)
    even = min(map(len, sets)) >= least
    return sets if len(together) == sum(map(len, sets)) == total and even else None


class SteadyLoad:
    """Threads sending greedy completions to the given controllers in turn, counting
    failures, until stopped."""

    def __init__(self, servers, threads: int = 6):
        self.servers = servers  # controllers to send to (round robin per thread)
        self.ok = 0  # completions that succeeded
        self.failures: list[str] = []  # what each failed one got
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self):
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self._threads:
            t.join(timeout=120)

    def _run(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            server = self.servers[turn % len(self.servers)]
            turn += 1
            prompt = [10 + turn % 50, 20 + index, 300 + turn % 7, 41, 42, 43]
            try:
                status, body, _ = complete(server, greedy(prompt, TOKENS), timeout=120)
            except httpx.HTTPError as exc:
                self.failures.append(repr(exc))
                continue
            if status == 200 and body["usage"]["completion_tokens"] == TOKENS:
                self.ok += 1
            else:
                self.failures.append(f"{status} {body}")


def test_controllers_split_rebalance_and_take_over(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=SIM_SPEED)
        for i in range(4)
    ]
    executor_args = sum((["--executor", f"127.0.0.1:{port}"] for _, port in sims), [])
    ports = [free_port() for _ in range(3)]
    peers = sum((["--peer", f"127.0.0.1:{p}"] for p in ports), [])

    def controller(i: int):
        args = [*SPLIT, *executor_args, *peers]
        return spawn_controller(default_model_dir, tmp, args, "abc"[i], port=ports[i])

    servers = []
    try:
        servers = [controller(0), controller(1)]
        a, b = servers
        wait_until(lambda: split_of([a, b], 2), 120, "a 2/2 split of a and b", logs=tmp)
        for server, other in ((a, b), (b, a)):  # the others' executors: idle, shown
            idle = [e for e in server.executors_state() if not e["owned"]]
            assert {e["state"] for e in idle} == {"assigned_elsewhere"}
            assert {e["assigned_to"] for e in idle} == {other.base_url.removeprefix("http://")}
            status, body, _ = complete(server, greedy([11, 12, 13, 14]), timeout=60)
            assert status == 200, body

        # A third controller joins under steady load: the executors rebalance, none fails.
        with SteadyLoad([a, b]) as load:
            time.sleep(1.0)
            servers.append(controller(2))
            joined = time.monotonic()
            three = wait_until(lambda: split_of(servers, 1), 120, "a 1-2 split", logs=tmp)
            rebalanced = time.monotonic() - joined
            time.sleep(2.0)  # load goes on over the new split
        assert load.failures == [], load.failures[:5]
        assert load.ok > 0
        assert split_of(servers) == three  # it holds
        for server in servers:
            state = server.wait_idle()
            assert all(e["used_blocks"] == 0 for e in state), state  # no leaked blocks
            status, body, _ = complete(server, greedy([21, 22, 23]), timeout=60)
            assert status == 200, body

        # SIGKILL the controller with the most executors: the others claim them.
        victim = max(range(3), key=lambda i: len(three[i]))
        servers[victim].controller.send_signal(signal.SIGKILL)
        servers[victim].controller.wait(timeout=30)
        killed = time.monotonic()
        survivors = [s for i, s in enumerate(servers) if i != victim]
        wait_until(lambda: split_of(survivors, 2), LEASE + SLACK + 20, "takeover", logs=tmp)
        takeover = time.monotonic() - killed
        assert takeover <= LEASE + 3 * PROBE + LEASE / 3 + SLACK
        for server in survivors:
            status, body, _ = complete(server, greedy([31, 32, 33]), timeout=60)
            assert status == 200, body
        print(
            f"\n2/2 split; c joined: rebalanced in {rebalanced:.2f}s with {load.ok} requests "
            f"served and 0 failed; SIGKILL of a controller with {len(three[victim])} "
            f"executors: claimed by the others in {takeover:.2f}s (lease {LEASE:g}s, "
            f"probe {PROBE:g}s)"
        )
    finally:
        for server in servers:
            server.stop()
        for proc, _ in sims:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in sims:
            proc.wait(timeout=30)


def failed_over(server) -> float:
    """Requests moved off this controller's executors (tandem:requests_failed_over)."""
    text = httpx.get(server.base_url + "/metrics", timeout=10).text
    lines = [ln for ln in text.splitlines() if ln.startswith("tandem:requests_failed_over_total")]
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines)


def test_a_hand_over_past_its_drain_moves_the_running_requests(default_model_dir, tmp_path):
    """A controller comes back (SIGSTOP past the lease, then SIGCONT) while the other drives its
    executor with requests running: the executor is handed back, and the requests still
    running when the drain runs out move to the other executor by the failover path. None
    fails, and the executor does not count as lost."""
    tmp = str(tmp_path)
    slow = ["--step-fixed-ms", "20", "--step-per-token-us", "5"]  # 150 tokens: about 3 s
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=slow)
        for i in range(2)
    ]
    executor_args = sum((["--executor", f"127.0.0.1:{port}"] for _, port in sims), [])
    ports = [free_port() for _ in range(2)]
    peers = sum((["--peer", f"127.0.0.1:{p}"] for p in ports), [])
    args = [*SPLIT, *executor_args, *peers, "--handover-drain-timeout", "0.5"]
    servers = []
    try:
        servers = [
            spawn_controller(default_model_dir, tmp, args, name, port=port)
            for name, port in zip("ab", ports)
        ]
        a, b = servers
        wait_until(lambda: split_of([a, b], 1, 2), 120, "a 1/1 split", logs=tmp)
        b.controller.send_signal(signal.SIGSTOP)
        wait_until(lambda: len(owned(a)) == 2, 60, "a to take b's executor", logs=tmp)
        results: list[tuple[int, dict]] = []

        def run(i: int) -> None:
            status, body, _ = complete(a, greedy([50 + i, 60, 70 + i], 150), timeout=120)
            results.append((status, body))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        wait_until(lambda: all(e["running"] for e in a.executors_state()), 30, "requests on both")
        b.controller.send_signal(signal.SIGCONT)  # b is back: its executor goes back to it
        wait_until(lambda: split_of([a, b], 1, 2), 60, "a 1/1 split again", logs=tmp)
        for t in threads:
            t.join(timeout=120)
        assert len(results) == 4
        for status, body in results:
            assert status == 200 and body["usage"]["completion_tokens"] == 150, body
        assert failed_over(a) > 0  # the drain ran out: requests moved
        assert all(e["losses"] == 0 for e in a.executors_state())  # a hand-over, no loss
        state = a.wait_idle()
        assert all(e["used_blocks"] == 0 for e in state), state
    finally:
        for server in servers:
            if server.controller.poll() is None:
                server.controller.send_signal(signal.SIGCONT)
            server.stop()
        for proc, _ in sims:
            proc.send_signal(signal.SIGTERM)
        for proc, _ in sims:
            proc.wait(timeout=30)
