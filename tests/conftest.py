"""Shared fixtures: the default model, the transformers reference, and live servers.

A live server is real processes: `python -m executor_gpu` and `python -m controller`, talking
gRPC to each other and HTTP to the test on localhost.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

import pytest

# Triton kernels run under Triton's interpreter on CPU tensors in this process (the flag must be
# set before triton is first imported; tests/test_triton_kernels.py relies on it).
os.environ.setdefault("TRITON_INTERPRET", "1")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")


def model_dir() -> str:
    return os.environ.get("TANDEM_MODEL_DIR", DEFAULT_MODEL_DIR)


@pytest.fixture(scope="session")
def default_model_dir() -> str:
    path = model_dir()
    if not os.path.exists(os.path.join(path, "config.json")):
        pytest.skip(f"default model missing at {path} (run `make model`)")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    """A controller and its executors, started as subprocesses."""

    base_url: str  # http://127.0.0.1:PORT
    model_name: str  # served model name
    controller: subprocess.Popen  # the controller process
    executors: list[subprocess.Popen] = field(default_factory=list)  # executor processes
    executor_ports: list[int] = field(default_factory=list)  # their gRPC ports
    log_dir: str = ""  # where process logs go

    def client(self, **kw):
        import openai

        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0,
                             timeout=kw.pop("timeout", 300), **kw)

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(base_url=self.base_url + "/v1", api_key="unused",
                                  max_retries=0, timeout=kw.pop("timeout", 300), **kw)

    def executors_state(self) -> list[dict]:
        import httpx

        return httpx.get(self.base_url + "/admin/executors", timeout=10).json()["executors"]

    def wait_idle(self, timeout: float = 30.0) -> list[dict]:
        """Wait until no request runs or waits anywhere; return the executors' state."""
        deadline = time.time() + timeout
        while True:
            state = self.executors_state()
            if all(e["running"] == 0 and e["waiting"] == 0 for e in state):
                return state
            if time.time() > deadline:
                return state
            time.sleep(0.2)

    def stop(self) -> None:
        for p in [self.controller, *self.executors]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [self.controller, *self.executors]:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def spawn_process(args: list[str], log_path: str) -> subprocess.Popen:
    """`python ARGS` from the repository root in a session of its own, output to log_path."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, *args], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def executor_command(module: str, model: str, port: int, extra=()) -> list[str]:
    """Arguments (after the interpreter) that start one executor for the tests."""
    return ["-m", module, "--model", model, "--host", "127.0.0.1", "--port", str(port),
            "--kv-cache-bytes", str(256 * 2**20), *extra]


def start_server(model: str, tmp_dir: str, controller_args=(), executor_args=(),
                 executor_kinds=("executor_gpu",), timeout: float = 600.0) -> LiveServer:
    """Start one executor per entry of executor_kinds (a module name each) and a controller;
    wait until /health answers 200."""
    import httpx

    executors, ports = [], []
    for i, module in enumerate(executor_kinds):
        port = free_port()
        executors.append(spawn_process(executor_command(module, model, port, executor_args),
                                os.path.join(tmp_dir, f"executor{i}.log")))
        ports.append(port)
    http_port = free_port()
    controller = spawn_process(
        ["-m", "controller", "--model", model, "--host", "127.0.0.1", "--port", str(http_port),
         *sum((["--executor", f"127.0.0.1:{p}"] for p in ports), []), *controller_args],
        os.path.join(tmp_dir, "controller.log"),
    )
    server = LiveServer(f"http://127.0.0.1:{http_port}", os.path.basename(model.rstrip("/")),
                        controller, executors, ports, tmp_dir)
    deadline = time.time() + timeout
    while True:
        for p in [controller, *executors]:
            if p.poll() is not None:
                server.stop()
                logs = _tail_logs(tmp_dir)
                raise RuntimeError(f"a server process exited early:\n{logs}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            server.stop()
            raise RuntimeError(f"server not healthy in {timeout}s:\n{_tail_logs(tmp_dir)}")
        time.sleep(0.5)


def _tail_logs(tmp_dir: str) -> str:
    out = []
    for name in sorted(os.listdir(tmp_dir)):
        if name.endswith(".log"):
            with open(os.path.join(tmp_dir, name)) as f:
                out.append(f"--- {name}\n" + "".join(f.readlines()[-40:]))
    return "\n".join(out)


@pytest.fixture(scope="session")
def server(default_model_dir, tmp_path_factory) -> LiveServer:
    """The default configuration: one executor, default budgets."""
    s = start_server(default_model_dir, str(tmp_path_factory.mktemp("server")))
    yield s
    s.stop()


@pytest.fixture(scope="session")
def tight_server(default_model_dir, tmp_path_factory) -> LiveServer:
    """A small step budget and few KV blocks: chunked prefill and preemption for sure."""
    s = start_server(
        default_model_dir, str(tmp_path_factory.mktemp("tight")),
        controller_args=["--max-num-batched-tokens", "48", "--num-kv-blocks", "20"],
    )
    yield s
    s.stop()


class HFReference:
    """Greedy generation and log-probs from transformers on the same weights (float32)."""

    def __init__(self, path: str):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self._cache: dict[tuple, list[int]] = {}

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation; stops at EOS like the server does (EOS included)."""
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            with self.torch.inference_mode():
                out = self.model.generate(
                    self.torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                    do_sample=False, pad_token_id=self.tokenizer.eos_token_id,
                )
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]

    def prompt_logprobs(self, prompt_ids: list[int]) -> list[float]:
        """log p(token i | tokens < i) for i >= 1."""
        with self.torch.inference_mode():
            logits = self.model(self.torch.tensor([prompt_ids])).logits[0].float()
        lp = self.torch.log_softmax(logits, dim=-1)
        return [lp[i - 1, prompt_ids[i]].item() for i in range(1, len(prompt_ids))]

    def chat_ids(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=False)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="session")
def hf(default_model_dir) -> HFReference:
    return HFReference(default_model_dir)


# --- Fleet helpers: executors on chosen addresses, controllers without fixed executors, -------
# --- waiting for the fleet, and a local DNS server for discovery tests. ----------------------


def executor_module_available(module: str) -> bool:
    """Whether `python -m module` exists in this checkout (e.g. executor_tpu)."""
    return os.path.exists(os.path.join(ROOT, module, "__main__.py"))


def spawn_executor(module: str, model: str, tmp_dir: str, name: str, port: int | None = None,
                   host: str = "127.0.0.1", extra=()) -> tuple[subprocess.Popen, int]:
    """Start one executor process listening on host:port; returns (process, port)."""
    port = port or free_port()
    args = executor_command(module, model, port, [*extra, "--host", host])
    return spawn_process(args, os.path.join(tmp_dir, f"{name}.log")), port


def spawn_controller(model: str, tmp_dir: str, args=(), name: str = "controller") -> LiveServer:
    """Start a controller with the given flags (executors included) without waiting."""
    http_port = free_port()
    controller = spawn_process(
        ["-m", "controller", "--model", model, "--host", "127.0.0.1", "--port", str(http_port),
         *args],
        os.path.join(tmp_dir, f"{name}.log"),
    )
    return LiveServer(f"http://127.0.0.1:{http_port}", os.path.basename(model.rstrip("/")),
                      controller, [], [], tmp_dir)


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def read_ports_files(files: list[str], timeout: float, logs: str = "") -> list[int]:
    """The ports that ``executor_sim --ports-file`` processes wrote, once every file exists
    (each is written whole, once all of its process's executors serve), in file order."""
    wait_until(lambda: all(os.path.exists(f) for f in files), timeout, "simulated executors",
               logs=logs)
    ports: list[int] = []
    for path in files:
        with open(path) as f:
            ports += [int(line) for line in f if line.strip()]
    return ports


def wait_until(predicate, timeout: float, what: str, interval: float = 0.2, logs: str = ""):
    """Poll `predicate` until it returns something truthy; fail with `what` after timeout."""
    deadline = time.time() + timeout
    while True:
        try:
            value = predicate()
        except Exception:  # the server may not answer yet
            value = None
        if value:
            return value
        if time.time() > deadline:
            tail = _tail_logs(logs) if logs else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(interval)


def wait_healthy_executors(server: LiveServer, count: int, timeout: float = 300.0) -> list[dict]:
    """Wait until at least `count` executors are healthy; return the executors' state."""
    def ready():
        state = server.executors_state()
        return state if sum(e["healthy"] for e in state) >= count else None

    return wait_until(ready, timeout, f"{count} healthy executors", logs=server.log_dir)


class LocalDNSServer:
    """A tiny DNS server on 127.0.0.1 for discovery tests.

    Answers A queries for the names it holds (one record per address, TTL 0), NXDOMAIN for
    other names, an empty answer for other types. Serves UDP and TCP on the same port; with
    `truncate_over` set, a UDP answer with more records is sent truncated (TC), so that the
    client must ask again over TCP.
    """

    def __init__(self, truncate_over: int = 0):
        import threading

        self.records: dict[str, list[str]] = {}  # lower-case name -> IPv4 addresses
        self.truncate_over = truncate_over  # most A records in a UDP answer; 0 = no limit
        self.queries = 0  # questions answered
        self._udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._udp.bind(("127.0.0.1", 0))
        self.port = self._udp.getsockname()[1]
        self._tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._tcp.bind(("127.0.0.1", self.port))
        self._tcp.listen(8)
        self._closed = False
        for target in (self._serve_udp, self._serve_tcp):
            threading.Thread(target=target, daemon=True).start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def set(self, name: str, addresses: list[str]) -> None:
        self.records[name.lower().rstrip(".")] = list(addresses)

    def _answer(self, query: bytes, udp: bool) -> bytes:
        import struct

        qid, flags = struct.unpack("!HH", query[:4])
        pos, labels = 12, []
        while query[pos]:
            labels.append(query[pos + 1 : pos + 1 + query[pos]].decode().lower())
            pos += 1 + query[pos]
        qtype, _ = struct.unpack("!HH", query[pos + 1 : pos + 5])
        question = query[12 : pos + 5]
        name = ".".join(labels)
        self.queries += 1
        out_flags = 0x8400 | (flags & 0x0100)  # response, authoritative, recursion desired
        if name not in self.records:
            return struct.pack("!HHHHHH", qid, out_flags | 3, 1, 0, 0, 0) + question
        addresses = self.records[name] if qtype == 1 else []
        if udp and self.truncate_over and len(addresses) > self.truncate_over:
            return struct.pack("!HHHHHH", qid, out_flags | 0x0200, 1, 0, 0, 0) + question
        answers = b"".join(
            struct.pack("!HHHIH", 0xC00C, 1, 1, 0, 4) + socket.inet_aton(a) for a in addresses
        )
        return struct.pack("!HHHHHH", qid, out_flags, 1, len(addresses), 0, 0) + question + answers

    def _serve_udp(self) -> None:
        while not self._closed:
            try:
                data, peer = self._udp.recvfrom(4096)
                self._udp.sendto(self._answer(data, udp=True), peer)
            except OSError:
                return
            except Exception:  # a malformed query: ignore it
                continue

    def _serve_tcp(self) -> None:
        import struct

        while not self._closed:
            try:
                conn, _ = self._tcp.accept()
            except OSError:
                return
            with conn:
                try:
                    (length,) = struct.unpack("!H", conn.recv(2))
                    data = b""
                    while len(data) < length:
                        data += conn.recv(length - len(data))
                    reply = self._answer(data, udp=False)
                    conn.sendall(struct.pack("!H", len(reply)) + reply)
                except Exception:  # a broken client: drop it
                    continue

    def close(self) -> None:
        self._closed = True
        self._udp.close()
        self._tcp.close()


# Fast failure detection for fleet tests: a check every 0.5 s, an executor is lost after 3
# unanswered checks of 1 s (generous on a busy 2-core machine).
FAST_HEALTH = ["--health-check-interval", "0.5", "--health-check-timeout", "1.0",
               "--health-check-failures", "3", "--reconnect-backoff-max", "1.0"]


@pytest.fixture(scope="session")
def executor_pair(default_model_dir, tmp_path_factory) -> LiveServer:
    """Two GPU executors (the CPU here) behind one controller, with fast failure detection.
    Tests that kill or stop one must leave both healthy again."""
    s = start_server(default_model_dir, str(tmp_path_factory.mktemp("pair")),
                     controller_args=FAST_HEALTH, executor_kinds=("executor_gpu",) * 2)
    wait_healthy_executors(s, 2)
    yield s
    for p in s.executors:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
    s.stop()
