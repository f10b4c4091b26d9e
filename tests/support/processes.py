"""Real processes for the tests: executors and controllers started as `python -m ...`
subprocesses, talking gRPC to each other and HTTP to the test on localhost, and helpers to wait
for them."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_MODEL_DIR = os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")


def model_dir() -> str:
    return os.environ.get("TANDEM_MODEL_DIR", DEFAULT_MODEL_DIR)


_HANDED_OUT: set[int] = set()  # ports free_port gave this process (their owners may not bind yet)


def free_port() -> int:
    """A port free now, never one this process was given before: a port handed out for a child
    that has not bound it yet is free to the kernel, which may hand it out again."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


@dataclass
class LiveServer:
    """A controller and its executors, started as subprocesses."""

    base_url: str  # http://127.0.0.1:PORT
    model_name: str  # served model name
    controller: subprocess.Popen  # the controller process
    executors: list[subprocess.Popen] = field(default_factory=list)  # executor processes
    executor_ports: list[int] = field(default_factory=list)  # their gRPC ports
    log_dir: str = ""  # where process logs go
    admin_key: str = ""  # the controller's --admin-api-key; "" = none (loopback reaches admin)
    executor_step_ports: list[int] = field(default_factory=list)  # their --step-port (if any)

    def client(self, **kw):
        import openai

        return openai.OpenAI(
            base_url=self.base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=kw.pop("timeout", 300),
            **kw,
        )

    def async_client(self, **kw):
        import openai

        return openai.AsyncOpenAI(
            base_url=self.base_url + "/v1",
            api_key="unused",
            max_retries=0,
            timeout=kw.pop("timeout", 300),
            **kw,
        )

    def admin_headers(self) -> dict[str, str]:
        """Headers of a request to /admin/* (the admin key, when the controller has one)."""
        return {"Authorization": f"Bearer {self.admin_key}"} if self.admin_key else {}

    def admin(self, path: str = "/admin/executors") -> dict:
        """An admin route's JSON answer (over loopback, with the admin key if any)."""
        import httpx

        return httpx.get(self.base_url + path, headers=self.admin_headers(), timeout=10).json()

    def executors_state(self) -> list[dict]:
        return self.admin("/admin/executors")["executors"]

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
    return subprocess.Popen(
        [sys.executable, *args],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def executor_command(module: str, model: str, port: int, extra=()) -> list[str]:
    """Arguments (after the interpreter) that start one executor for the tests."""
    return [
        "-m",
        module,
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kv-cache-bytes",
        str(256 * 2**20),
        *extra,
    ]


def start_server(
    model: str,
    tmp_dir: str,
    controller_args=(),
    executor_args=(),
    executor_kinds=("executor_gpu",),
    timeout: float = 600.0,
    step_sockets: bool = False,
) -> LiveServer:
    """Start one executor per entry of executor_kinds (a module name each) and a controller;
    wait until /health answers 200. `step_sockets`: each executor also serves a step socket
    (--step-port, a free port each)."""
    import httpx

    executors, ports, step_ports = [], [], []
    for i, module in enumerate(executor_kinds):
        port = free_port()
        args = list(executor_args)
        if step_sockets:
            step_ports.append(free_port())
            args += ["--step-port", str(step_ports[-1])]
        executors.append(
            spawn_process(
                executor_command(module, model, port, args),
                os.path.join(tmp_dir, f"executor{i}.log"),
            )
        )
        ports.append(port)
    http_port = free_port()
    controller = spawn_process(
        [
            "-m",
            "controller",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(http_port),
            *sum((["--executor", f"127.0.0.1:{p}"] for p in ports), []),
            *controller_args,
        ],
        os.path.join(tmp_dir, "controller.log"),
    )
    server = LiveServer(
        f"http://127.0.0.1:{http_port}",
        os.path.basename(model.rstrip("/")),
        controller,
        executors,
        ports,
        tmp_dir,
        executor_step_ports=step_ports,
    )
    deadline = time.time() + timeout
    while True:
        for p in [controller, *executors]:
            if p.poll() is not None:
                server.stop()
                logs = tail_logs(tmp_dir)
                raise RuntimeError(f"a server process exited early:\n{logs}")
        try:
            if httpx.get(server.base_url + "/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if time.time() > deadline:
            server.stop()
            raise RuntimeError(f"server not healthy in {timeout}s:\n{tail_logs(tmp_dir)}")
        time.sleep(0.5)


def tail_logs(tmp_dir: str) -> str:
    out = []
    for name in sorted(os.listdir(tmp_dir)):
        if name.endswith(".log"):
            with open(os.path.join(tmp_dir, name)) as f:
                out.append(f"--- {name}\n" + "".join(f.readlines()[-40:]))
    return "\n".join(out)


def executor_module_available(module: str) -> bool:
    """Whether `python -m module` exists in this checkout (e.g. executor_tpu)."""
    return os.path.exists(os.path.join(ROOT, module, "__main__.py"))


def spawn_executor(
    module: str,
    model: str,
    tmp_dir: str,
    name: str,
    port: int | None = None,
    host: str = "127.0.0.1",
    extra=(),
) -> tuple[subprocess.Popen, int]:
    """Start one executor process listening on host:port; returns (process, port)."""
    port = port or free_port()
    args = executor_command(module, model, port, [*extra, "--host", host])
    return spawn_process(args, os.path.join(tmp_dir, f"{name}.log")), port


def spawn_controller(
    model: str, tmp_dir: str, args=(), name: str = "controller", port: int | None = None
) -> LiveServer:
    """Start a controller with the given flags (executors included) without waiting, on
    `port` (default: a free one)."""
    http_port = port or free_port()
    controller = spawn_process(
        [
            "-m",
            "controller",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(http_port),
            *args,
        ],
        os.path.join(tmp_dir, f"{name}.log"),
    )
    return LiveServer(
        f"http://127.0.0.1:{http_port}",
        os.path.basename(model.rstrip("/")),
        controller,
        [],
        [],
        tmp_dir,
    )


def rss_mib(pid: int) -> float:
    """Resident memory of a process, MiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


class PeakRSS:
    """Samples a process's resident memory in a thread while a block runs; ``base`` is the
    RSS when the block began, ``peak`` the largest seen (MiB)."""

    def __init__(self, pid: int, interval: float = 0.25):
        self.pid, self.interval = pid, interval
        self.base = self.peak = rss_mib(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except (OSError, RuntimeError):  # the process is gone
                return

    def __enter__(self) -> PeakRSS:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def write_executor_file(path: str, addresses: list[str]) -> None:
    """Write an --executor-file listing whole (renamed into place): the controller rereads it
    at any moment and must never see half of it."""
    with open(path + ".tmp", "w") as f:
        f.write("".join(a + "\n" for a in addresses))
    os.replace(path + ".tmp", path)


def grpc_health(address: str, timeout: float = 2.0) -> str:
    """The grpc.health.v1 status of the server at ``address`` ("SERVING", "NOT_SERVING", ...),
    or "GONE" when nothing answers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            status = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=timeout
            )
    except grpc.RpcError:
        return "GONE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(status.status)


def read_ports_files(files: list[str], timeout: float, logs: str = "") -> list[int]:
    """The ports that ``executor_sim --ports-file`` processes wrote, once every file exists
    (each is written whole, once all of its process's executors serve), in file order."""
    wait_until(
        lambda: all(os.path.exists(f) for f in files), timeout, "simulated executors", logs=logs
    )
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
            tail = tail_logs(logs) if logs else ""
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{tail}")
        time.sleep(interval)


def wait_healthy_executors(server: LiveServer, count: int, timeout: float = 300.0) -> list[dict]:
    """Wait until at least `count` executors are healthy; return the executors' state."""

    def ready():
        state = server.executors_state()
        return state if sum(e["healthy"] for e in state) >= count else None

    return wait_until(ready, timeout, f"{count} healthy executors", logs=server.log_dir)


# Fast failure detection for fleet tests: a check every 0.5 s, an executor is lost after 3
# unanswered checks of 1 s (generous on a busy 2-core machine).
FAST_HEALTH = [
    "--health-check-interval",
    "0.5",
    "--health-check-timeout",
    "1.0",
    "--health-check-failures",
    "3",
    "--reconnect-backoff-max",
    "1.0",
]


def spawn_serve(argv: list[str], log_path: str) -> subprocess.Popen:
    """`python -m tandem serve ARGV` from the repository root, output to `log_path`, in a
    process group of its own (its children are found by it)."""
    with open(log_path, "w") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "tandem", "serve", *argv],
            cwd=ROOT,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
