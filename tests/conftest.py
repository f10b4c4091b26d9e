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


def _spawn(args: list[str], log_path: str) -> subprocess.Popen:
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
        executors.append(_spawn(executor_command(module, model, port, executor_args),
                                os.path.join(tmp_dir, f"executor{i}.log")))
        ports.append(port)
    http_port = free_port()
    controller = _spawn(
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
