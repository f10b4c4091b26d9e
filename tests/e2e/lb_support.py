"""Two controllers behind a real haproxy (the launcher's config, tests/support/balancer.py) over
given executors, and closed-loop clients through haproxy that record what each request got:
its status, its text, whether a stream ended with [DONE], which controller answered."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
import openai

from tests.support.balancer import LiveBalancer, start_balancer
from tests.support.processes import (
    FAST_HEALTH,
    LiveServer,
    free_port,
    spawn_controller,
    wait_until,
)

IGNORE_EOS = {"ignore_eos": True}  # every completion runs to max_tokens
LEASE = 3.0  # the controllers' lease on each executor, renewed every second
PROBE = 0.5  # seconds between peer probes: a peer is judged gone 1.5 s after its last answer
CONTROLLER_ARGS = [
    *FAST_HEALTH,
    "--executor-lease-seconds",
    str(LEASE),
    "--peer-probe-interval",
    str(PROBE),
    "--handover-drain-timeout",
    "10",
]


def owned(server: LiveServer) -> set[str]:
    """The executors a controller drives now (healthy, under its lease)."""
    return {e["address"] for e in server.executors_state() if e["healthy"] and e["owned"]}


@dataclass
class LbFleet:
    """Controllers c0, c1 (peers of each other) over the same executors, haproxy in front."""

    model: str  # model folder every controller serves
    tmp: str  # logs, haproxy's run folder
    executors: list[str]  # executor addresses
    ports: dict[str, int]  # controller name -> its HTTP port
    controllers: dict[str, LiveServer] = field(default_factory=dict)  # name -> live process
    balancer: LiveBalancer | None = None  # haproxy
    restarts: int = 0  # controllers started again (each gets its own log)

    @property
    def base_url(self) -> str:
        return self.balancer.base_url

    def spawn(self, name: str) -> LiveServer:
        """Start controller ``name`` on its port (again, after a restart)."""
        args = [*CONTROLLER_ARGS, *sum((["--executor", a] for a in self.executors), [])]
        args += sum((["--peer", f"127.0.0.1:{p}"] for p in self.ports.values()), [])
        log = f"{name}-{self.restarts}"
        self.restarts += 1
        server = spawn_controller(self.model, self.tmp, args, log, port=self.ports[name])
        self.controllers[name] = server
        return server

    def split(self) -> list[set[str]] | None:
        """Each controller's executors once together they drive all, each exactly once, and
        evenly (sizes differ by at most one); else None."""
        sets = [owned(s) for s in self.controllers.values()]
        together = set().union(*sets)
        sizes = sorted(map(len, sets))
        whole = len(together) == sum(sizes) == len(self.executors)
        return sets if whole and sizes[-1] - sizes[0] <= 1 else None

    def serving(self) -> bool:
        """haproxy sees every controller UP and they drive all executors evenly."""
        states = self.balancer.states()
        return all(states.get(n) == "UP" for n in self.controllers) and bool(self.split())

    def stop(self) -> None:
        if self.balancer is not None:
            self.balancer.stop()
        for server in self.controllers.values():
            if server.controller.poll() is None:
                server.controller.send_signal(signal.SIGCONT)
            server.stop()


def start_lb_fleet(model: str, tmp: str, executors: list[str]) -> LbFleet:
    """c0 and c1 over ``executors``, haproxy in front; returns once both serve."""
    fleet = LbFleet(model, tmp, executors, {"c0": free_port(), "c1": free_port()})
    try:
        for name in fleet.ports:
            fleet.spawn(name)
        servers = {name: f"127.0.0.1:{port}" for name, port in fleet.ports.items()}
        fleet.balancer = start_balancer(tmp, servers)
        wait_until(fleet.serving, 600, "both controllers UP, executors split", logs=tmp)
    except BaseException:
        fleet.stop()
        raise
    return fleet


@dataclass
class Outcome:
    """What one request through haproxy got."""

    prompt: int  # index of its prompt
    streamed: bool  # stream=true
    started: float  # monotonic seconds
    ended: float = 0.0  # monotonic seconds
    status: int = 0  # HTTP status (0: no response)
    text: str = ""  # the completion's text (what arrived, for a stream)
    done: bool = False  # a stream ended with data: [DONE]
    controller: str = ""  # X-Tandem-Controller: the controller that answered
    error: str = ""  # the client's exception, if any

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error and (self.done or not self.streamed)


class ClosedLoop:
    """`threads` clients, each sending one request after the other (``send(prompt index,
    streamed, open, thread) -> Outcome``; a sender may show its request in ``open[thread]``
    while it runs), alternating streamed and not, until stopped."""

    def __init__(self, send: Callable[..., Outcome], prompts: int, threads: int = 4):
        self.send = send  # performs one request
        self.prompts = prompts  # how many prompts to cycle through
        self.outcomes: list[Outcome] = []  # every finished request
        self.open: dict[int, Outcome] = {}  # thread -> its request in flight
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(threads)]

    def __enter__(self) -> ClosedLoop:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=300)

    def ok_count(self) -> int:
        return sum(o.ok for o in self.outcomes)

    def _run(self, index: int) -> None:
        turn = index
        while not self._stop.is_set():
            outcome = self.send(
                turn % self.prompts, bool((turn // 2 + index) % 2), self.open, index
            )
            self.outcomes.append(outcome)
            turn += 1


def openai_sender(base_url: str, model: str, prompts: list[str], max_tokens: int):
    """A ClosedLoop sender through the official openai client (greedy, ignore_eos)."""
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=300)

    def send(i: int, streamed: bool, open_: dict, thread: int) -> Outcome:
        outcome = Outcome(i, streamed, time.monotonic())
        args = dict(model=model, prompt=prompts[i], max_tokens=max_tokens, temperature=0)
        try:
            if streamed:
                stream = client.completions.create(**args, stream=True, extra_body=IGNORE_EOS)
                outcome.status = 200
                for chunk in stream:
                    outcome.text += "".join(c.text for c in chunk.choices)
                outcome.done = True  # the client ends iteration at [DONE] only
            else:
                reply = client.completions.create(**args, extra_body=IGNORE_EOS)
                outcome.status, outcome.text = 200, reply.choices[0].text
        except openai.APIError as exc:
            outcome.error = repr(exc)
        outcome.ended = time.monotonic()
        return outcome

    return send


def raw_sender(base_url: str, model: str, prompts: list[list[int]], max_tokens: int):
    """A ClosedLoop sender over plain httpx, which sees what the openai client hides: which
    controller answered, whether a stream ended with [DONE], the transport's error."""

    def send(i: int, streamed: bool, open_: dict, thread: int) -> Outcome:
        outcome = Outcome(i, streamed, time.monotonic())
        body = {"model": model, "prompt": prompts[i], "max_tokens": max_tokens}
        body |= {"temperature": 0, "stream": streamed, **IGNORE_EOS}
        open_[thread] = outcome
        try:
            with httpx.stream("POST", base_url + "/v1/completions", json=body, timeout=300) as resp:
                outcome.status = resp.status_code
                outcome.controller = resp.headers.get("x-tandem-controller", "")
                if streamed:
                    read_stream(resp, outcome)
                else:
                    resp.read()
                    outcome.text = resp.json()["choices"][0]["text"] if resp.is_success else ""
        except httpx.HTTPError as exc:
            outcome.error = type(exc).__name__
        finally:
            open_.pop(thread, None)
        outcome.ended = time.monotonic()
        return outcome

    return send


def read_stream(resp: httpx.Response, outcome: Outcome) -> None:
    """Collect an SSE completion stream's text into ``outcome``, and whether it ended with
    [DONE] (a transport error propagates)."""
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            outcome.done = True
            continue
        outcome.text += "".join(c["text"] for c in json.loads(data)["choices"])
