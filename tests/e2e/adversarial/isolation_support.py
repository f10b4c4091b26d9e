"""What the isolation tests share: simulated fleets with injected faults (executor_sim's
--fault), the controller's executor-loss counter and RSS, and greedy completions by token ids
whose answers are compared before and during an attack."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import httpx

from tests.support.processes import (
    FAST_HEALTH,
    LiveServer,
    free_port,
    rss_mib,
    spawn_controller,
    spawn_executor,
    wait_healthy_executors,
)

SIM_SPEED = ["--step-fixed-ms", "2", "--step-per-token-us", "5"]  # a fast simulated device
INNOCENT_PROMPTS = [[10 + i, 200 + i, 3000 + i, 40 + i, 5 + i] for i in range(6)]


def start_sim_fleet(
    model: str,
    tmp: str,
    executors: list[list[str]],
    controller_args: list[str] = (),
    healthy: int | None = None,
) -> LiveServer:
    """One simulated executor per entry (its extra flags) and a controller over them all
    (static addresses, fast failure detection); waits for `healthy` executors (all)."""
    procs, ports = [], []
    for i, extra in enumerate(executors):
        proc, port = spawn_executor(
            "executor_sim", model, tmp, f"sim{i}", port=free_port(), extra=[*SIM_SPEED, *extra]
        )
        procs.append(proc)
        ports.append(port)
    args = [*FAST_HEALTH, *sum((["--executor", f"127.0.0.1:{p}"] for p in ports), [])]
    server = spawn_controller(model, tmp, [*args, *controller_args])
    server.executors, server.executor_ports = procs, ports
    wait_healthy_executors(server, len(executors) if healthy is None else healthy, 120)
    return server


def controller_rss(server: LiveServer) -> float:
    return rss_mib(server.controller.pid)


def complete(server: LiveServer, body: dict, timeout: float = 60.0) -> tuple[int, dict, float]:
    """POST /v1/completions: (status, JSON body, seconds)."""
    started = time.perf_counter()
    resp = httpx.post(
        server.base_url + "/v1/completions",
        json={"model": server.model_name, **body},
        timeout=timeout,
    )
    return resp.status_code, resp.json(), time.perf_counter() - started


def greedy(prompt: list[int], max_tokens: int = 12) -> dict:
    """A greedy completion of token ids that runs to max_tokens."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def greedy_texts(server: LiveServer, prompts: list[list[int]]) -> list[str]:
    """Each prompt's greedy text, one request at a time (the references)."""
    texts = []
    for prompt in prompts:
        status, body, _ = complete(server, greedy(prompt))
        assert status == 200, body
        texts.append(body["choices"][0]["text"])
    return texts


@dataclass
class InnocentLoad:
    """Greedy requests sent in a loop from threads while an attack runs; each answer is
    checked against its reference."""

    server: LiveServer
    prompts: list[list[int]]  # one prompt per thread
    references: list[str]  # their greedy texts before the attack
    results: list[tuple[int, bool, float]] = field(default_factory=list)  # status, same, secs
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def _loop(self, i: int) -> None:
        while not self._stop.is_set():
            try:
                status, body, secs = complete(self.server, greedy(self.prompts[i]))
                same = status == 200 and body["choices"][0]["text"] == self.references[i]
                self.results.append((status, same, secs))
            except httpx.HTTPError as exc:  # counted as a failure
                self.results.append((-1, False, repr(exc)))  # type: ignore[arg-type]

    def __enter__(self) -> InnocentLoad:
        for i in range(len(self.prompts)):
            thread = threading.Thread(target=self._loop, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=120)

    def check(self, at_least: int = 1) -> None:
        """Every innocent request answered 200 with its reference text."""
        assert len(self.results) >= at_least, self.results
        bad = [r for r in self.results if r[0] != 200 or not r[1]]
        assert not bad, f"{len(bad)} of {len(self.results)} innocent requests hurt: {bad[:5]}"
