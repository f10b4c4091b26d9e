"""Prefix affinity between controllers that serve HTTPS: a request sent to the controller that
is not its prompt's home is forwarded to the home over HTTPS (the peers' probes and the
forwarding both speak TLS to a peer whose certificate the sender does not verify: peers are
found by address, and the client-facing certificate names the service, not each pod). The
answer, streamed or not, equals a direct request at the home, and the home ran it."""

from __future__ import annotations

import json
import random
import ssl

import httpx

from tests.e2e.adversarial.isolation_support import SIM_SPEED
from tests.e2e.helpers import metric_sum
from tests.e2e.test_peer_affinity import KEY_TOKENS, OUTCOME, prompt_homed_at
from tests.e2e.test_tls import _make_certs
from tests.support.processes import free_port, spawn_controller, spawn_executor, wait_until

PROBE = 0.5  # seconds between peer probes


class Https:
    """One HTTPS controller, reached with the test CA."""

    def __init__(self, server, ca: str):
        self.server = server
        self.url = server.base_url.replace("http://", "https://")
        self.http = httpx.Client(verify=ssl.create_default_context(cafile=ca), timeout=60)

    def metric(self, name: str) -> float:
        return metric_sum(self.http.get(self.url + "/metrics").text, name)

    def owned(self) -> int:
        state = self.http.get(self.url + "/admin/executors").json()["executors"]
        return sum(1 for e in state if e["healthy"] and e["owned"])

    def live_controllers(self) -> int:
        """How many controllers (itself included) its peer probes find live."""
        return self.http.get(self.url + "/peer").json()["live_controllers"]

    def healthy(self) -> bool:
        try:
            return self.http.get(self.url + "/health").status_code == 200
        except httpx.HTTPError:
            return False

    def greedy(self, prompt: list[int], stream: bool) -> str:
        body = {"model": self.server.model_name, "prompt": prompt, "max_tokens": 12}
        body |= {"temperature": 0, "stream": stream}
        if not stream:
            r = self.http.post(self.url + "/v1/completions", json=body)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["text"]
        text, done = "", False
        with self.http.stream("POST", self.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    text += "".join(c["text"] for c in chunk["choices"])
        assert done
        return text


def test_forwarding_between_https_controllers(default_model_dir, tmp_path):
    tmp = str(tmp_path)
    certs = _make_certs(tmp)
    sims = [
        spawn_executor("executor_sim", default_model_dir, tmp, f"sim{i}", extra=SIM_SPEED)
        for i in range(2)
    ]
    executor_args = sum((["--executor", f"127.0.0.1:{port}"] for _, port in sims), [])
    ports = [free_port(), free_port()]
    keys = [f"127.0.0.1:{p}" for p in ports]
    peers = sum((["--peer", k] for k in keys), [])
    tls = ["--ssl-certfile", certs["executor.pem"], "--ssl-keyfile", certs["executor.key"]]
    args = ["--peer-probe-interval", str(PROBE), *tls, *executor_args, *peers]
    servers = [
        spawn_controller(default_model_dir, tmp, args, n, port=p)
        for n, p in zip("ab", ports, strict=True)
    ]
    a, b = (Https(s, certs["ca.pem"]) for s in servers)
    try:
        wait_until(lambda: a.healthy() and b.healthy(), 120, "both controllers", logs=tmp)
        wait_until(lambda: a.owned() == b.owned() == 1, 120, "a 1/1 split", logs=tmp)
        # The split can come from the leases alone: wait for the probes (over HTTPS) too.
        live = lambda: a.live_controllers() == b.live_controllers() == 2  # noqa: E731
        wait_until(live, 30, "each live in the other's view", logs=tmp)
        at_b = prompt_homed_at(keys[1], keys, random.Random(11), length=KEY_TOKENS + 20)
        direct = b.greedy(at_b, stream=False)
        b_ran = b.metric("vllm:request_success_total")
        for stream in (False, True):
            assert a.greedy(at_b, stream=stream) == direct
        assert a.metric(OUTCOME % "forwarded") == 2
        assert b.metric(OUTCOME % "for_peer") == 2
        assert b.metric("vllm:request_success_total") == b_ran + 2
        assert a.metric(OUTCOME % "fallback") == 0
    finally:
        for side in (a, b):
            side.http.close()
        for server in servers:
            server.stop()
        for process, _ in sims:
            process.kill()
            process.wait()
