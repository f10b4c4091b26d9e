"""Prefix affinity across controllers, with real processes: two controllers that list each other
as peers (API keys on) over four simulated executors. A request sent to the controller that is
not its prompt's home is forwarded to the home (non-streamed and streamed answers equal to a
direct request at the home, the home's metrics count it); the second request of a prefix group
finds the prefix cached even when it lands on the other controller; keys are enforced on both
hops; a forged forwarding header neither loops nor bypasses the key; a client leaving a
forwarded stream frees the home's blocks; with the home frozen or gone the request is served
where it landed, and a forwarded non-streamed request whose home is killed under it runs again
where it landed."""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
import openai

from controller.fleet.affinity import home_of, routing_key
from tests.e2e.adversarial.isolation_support import SIM_SPEED
from tests.e2e.helpers import metric_sum, metrics_text
from tests.support.processes import (
    FAST_HEALTH,
    free_port,
    spawn_controller,
    spawn_executor,
    wait_until,
)

KEY = "affinity-test-key"
PROBE = 0.5  # seconds between peer probes
KEY_TOKENS = 256  # the controllers' --peer-affinity-key-tokens (the default)
FORWARDED = "X-Tandem-Forwarded-By"
OUTCOME = 'tandem:peer_affinity_requests_total{outcome="%s"}'


def owned(server) -> set[str]:
    return {e["address"] for e in server.executors_state() if e["healthy"] and e["owned"]}


def outcome(server, name: str) -> float:
    return metric_sum(metrics_text(server), OUTCOME % name)


def served(server) -> float:
    """Requests this controller ran on its executors (vllm:request_success)."""
    return metric_sum(metrics_text(server), "vllm:request_success_total")


def prefix_hits(servers) -> float:
    return sum(metric_sum(metrics_text(s), "vllm:prefix_cache_hits_total") for s in servers)


def idle_blocks(server) -> bool:
    """No request runs or waits on the executors it drives, and none holds a KV block."""
    states = [e for e in server.executors_state() if e["owned"]]
    return all(e["running"] == e["waiting"] == e["used_blocks"] == 0 for e in states)


def running(server) -> int:
    return sum(e["running"] for e in server.executors_state() if e["owned"])


def post_json(server, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": server.model_name, **body}
    return httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=120)


def see_each_other(servers) -> bool:
    """Every controller's probes find all of them live (/peer's live_controllers): until then a
    controller is its own prompts' only home, and an executor split can come from the leases'
    first come, first served start alone."""
    urls = [s.base_url + "/peer" for s in servers]
    return all(httpx.get(u, timeout=5).json()["live_controllers"] == len(urls) for u in urls)


def b_is_home_again(a, prompt: list[int]) -> bool:
    """A request sent to a whose home is b is forwarded again (b answers a's probes)."""
    before = outcome(a, "forwarded")
    assert post(a, prompt, {"Authorization": f"Bearer {KEY}"}).status_code == 200
    return outcome(a, "forwarded") == before + 1


def prompt_homed_at(home: str, keys: list[str], rng: random.Random, length: int = 300):
    """A prompt of token ids whose home (idle controllers) is `home`."""
    while True:
        prompt = [rng.randrange(1000, 40000) for _ in range(length)]
        if home_of(routing_key(prompt, KEY_TOKENS), dict.fromkeys(keys, 0), 1.25) == home:
            return prompt


def client(server, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def greedy_text(server, prompt: list[int], stream: bool = False, **kw) -> str:
    args = dict(model=server.model_name, prompt=prompt, max_tokens=16, temperature=0, **kw)
    if not stream:
        return client(server).completions.create(**args).choices[0].text
    chunks = client(server).completions.create(stream=True, **args)
    return "".join(c.choices[0].text for c in chunks if c.choices)


def post(server, prompt: list[int], headers: dict) -> httpx.Response:
    body = {"model": server.model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0}
    return httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_requests_meet_at_their_prompts_home(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=SIM_SPEED)
        for i in range(4)
    ]
    executor_args = sum((["--executor", f"127.0.0.1:{port}"] for _, port in sims), [])
    ports = [free_port(), free_port()]
    keys = [f"127.0.0.1:{p}" for p in ports]
    peers = sum((["--peer", k] for k in keys), [])
    args = [*FAST_HEALTH, "--peer-probe-interval", str(PROBE), "--api-key", KEY]
    servers = [
        spawn_controller(default_model_dir, tmp, [*args, *executor_args, *peers], n, port=p)
        for n, p in zip("ab", ports, strict=True)
    ]
    a, b = servers
    try:
        wait_until(lambda: len(owned(a)) == len(owned(b)) == 2, 120, "a 2/2 split", logs=tmp)
        wait_until(lambda: see_each_other(servers), 30, "each live in the other's view", logs=tmp)
        rng = random.Random(5)
        at_b = prompt_homed_at(keys[1], keys, rng)

        # Through a (not its home) and directly at b: the same texts; b ran both.
        direct = greedy_text(b, at_b)
        a_served, b_served = served(a), served(b)
        assert greedy_text(a, at_b) == direct
        assert greedy_text(a, at_b, stream=True) == direct
        assert outcome(a, "forwarded") == 2 and outcome(b, "for_peer") == 2
        assert served(a) == a_served and served(b) == b_served + 2

        # A chat whose home is one of them: the same answer through either.
        chat = [{"role": "system", "content": "You answer in French. " * 40}]
        chat.append({"role": "user", "content": "Name a colour."})
        answers = [
            client(s)
            .chat.completions.create(model=s.model_name, messages=chat, max_tokens=8, temperature=0)
            .choices[0]
            .message.content
            for s in servers
        ]
        assert answers[0] == answers[1]
        assert outcome(a, "forwarded") + outcome(b, "forwarded") == 3  # exactly one hop

        # A prefix group: the first request at its home, the second lands on the other one.
        shared = prompt_homed_at(keys[1], keys, rng)
        greedy_text(b, shared + [7] * 20)
        before = prefix_hits(servers)
        greedy_text(a, shared + [9] * 20)
        assert prefix_hits(servers) - before >= KEY_TOKENS

        # Keys on both hops; a forged header only keeps the request where it landed.
        assert post(a, at_b, {}).status_code == 401
        assert post(a, at_b, {FORWARDED: keys[1]}).status_code == 401
        assert post(a, at_b, {"Authorization": "Bearer wrong", FORWARDED: "x"}).status_code == 401
        a_for_peer, b_for_peer = outcome(a, "for_peer"), outcome(b, "for_peer")
        ok = post(a, at_b, {"Authorization": f"Bearer {KEY}", FORWARDED: keys[1]})
        assert ok.status_code == 200, ok.text
        assert outcome(a, "for_peer") == a_for_peer + 1  # served at a, no hop
        assert outcome(b, "for_peer") == b_for_peer

        # A client that leaves a forwarded stream: the home aborts it, no block stays in use.
        stream = client(a).completions.create(
            model=a.model_name,
            prompt=at_b,
            max_tokens=5000,  # >= 10 s of 2 ms steps: the wait below is shorter
            stream=True,
            extra_body={"ignore_eos": True},
        )
        next(iter(stream))
        stream.close()
        wait_until(lambda: idle_blocks(b), 5, "b's executors idle, no block in use", logs=tmp)

        # The home frozen after it accepted the connection: served here once it leaves the
        # live set (3 probe periods), not held until it wakes.
        b.controller.send_signal(signal.SIGSTOP)
        here = outcome(a, "fallback") + outcome(a, "local")
        started = time.monotonic()
        assert greedy_text(a, at_b) == direct
        frozen_for = time.monotonic() - started
        assert outcome(a, "fallback") + outcome(a, "local") == here + 1
        assert frozen_for < 3 * PROBE + 10.0  # the peer window, a probe, a loaded machine
        print(f"\nhome frozen: served by the receiving controller after {frozen_for:.2f}s")

        # The home killed while a forwarded non-streamed request runs there: the connection
        # breaks before any byte of the answer (its headers come when it is complete), so the
        # request runs again here and its client gets the whole answer.
        b.controller.send_signal(signal.SIGCONT)
        wait_until(lambda: b_is_home_again(a, at_b), 30, "b live again in a's view", logs=tmp)
        long = {"prompt": at_b, "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
        result: list = []
        fallbacks = outcome(a, "fallback")
        runner = threading.Thread(target=lambda: result.append(post_json(a, long)))
        runner.start()
        wait_until(lambda: running(b) > 0, 30, "the forwarded request running on b", logs=tmp)
        b.controller.send_signal(signal.SIGKILL)
        b.controller.wait(timeout=30)
        runner.join(timeout=120)
        (answer,) = result
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 3000
        assert outcome(a, "fallback") == fallbacks + 1  # run again here

        # The home gone: served where it landed.
        here = outcome(a, "fallback") + outcome(a, "local")
        forwarded = outcome(a, "forwarded")
        assert greedy_text(a, at_b) == direct
        assert outcome(a, "fallback") + outcome(a, "local") == here + 1
        assert outcome(a, "forwarded") == forwarded
    finally:
        for server in servers:
            server.stop()
        for proc, _ in sims:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
