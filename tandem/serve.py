"""`tandem serve`: a model served locally, as `make run` and `make fleet` do.

The executor(s) --executor names run as child processes on 127.0.0.1 (gpu: CUDA, else the
CPU; tpu: a TPU, else XLA:CPU; both: the two, the TPU one on --executor-port + 1; sim: a
simulated device, for the control plane alone) and the controller in front of them takes every
flag serve does not know. With --controllers N > 1, N controllers (peers of each other, on
loopback ports of their own) divide the executors, and haproxy on --host:--port balances the
clients across them (tandem/balancer.py). Without --model the default model is served,
converted on first use. SIGINT/SIGTERM stop the children (the controllers drain first); a
child that dies stops the others and serve exits non-zero.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Literal

from common.hub.settings import ModelSourceSettings
from common.settings import TandemSettings, setting
from common.settings.cli import load_settings
from controller.settings import ControllerConfig
from tandem import balancer
from tandem import model as default_model
from tandem.haproxy_config import Backend, BalancerOptions

DESCRIPTION = (
    "Serve a model locally: the controller and its executor(s) as child processes. Flags "
    "other than these go to the controller (see `tandem controller --help`); without --model "
    f"it serves {default_model.DEFAULT_MODEL_DIR}, converted on first use."
)
EXECUTOR_MODULES = {
    "gpu": ("executor_gpu",),
    "tpu": ("executor_tpu",),
    "both": ("executor_gpu", "executor_tpu"),
    "sim": ("executor_sim",),  # a simulated device: the control plane alone, no model run
}
#: Controller defaults that differ under serve: the default model, and a local address.
CONTROLLER_DEFAULTS = {"model": default_model.DEFAULT_MODEL_DIR, "host": "127.0.0.1"}
EXECUTOR_HOST = "127.0.0.1"  # the children listen on loopback only
POLL_SECONDS = 0.5  # how often the children are checked


class ServeSettings(TandemSettings):
    """What serve itself decides: which executors run, on which ports, with what flags."""

    executor: Literal["gpu", "tpu", "both", "sim"] = setting(
        "gpu",
        "executors to start: gpu (CUDA, else the CPU), tpu (a TPU, else XLA:CPU), both "
        "(the TPU one on --executor-port + 1) or sim (a simulated device, executors.md)",
    )
    executor_port: int = setting(50051, "gRPC port of the (first) executor")
    executor_step_port: int = setting(
        50061,
        "step socket port of the (first) executor, the next one's one up (0 = off: the "
        "controller sends steps over gRPC; executors.md)",
        ge=0,
    )
    executor_args: str = setting(
        "",
        "more flags for every executor, one string (e.g. --executor-args='--kv-cache-bytes "
        "536870912')",
        metavar="FLAGS",
    )
    tpu_args: str = setting(
        "",
        "more flags for the TPU executor (e.g. --tpu-args='--token-buckets 32,128')",
        metavar="FLAGS",
    )
    controllers: int = setting(
        1,
        "controllers to start; more than 1: peers of each other on loopback ports of their own "
        "(--controller-port and up), behind haproxy on --host:--port",
        ge=1,
    )
    controller_port: int = setting(
        0, "with --controllers > 1: the first controller's HTTP port (0 = --port + 1)"
    )
    run_dir: str = setting(
        "",
        "with --controllers > 1: the folder for haproxy's config and admin socket ('' = a new "
        "temporary one)",
        metavar="DIR",
    )


@dataclass
class Child:
    """A process serve started."""

    name: str  # module it runs
    command: list[str]  # its command line
    process: subprocess.Popen | None = None  # once started
    stop_signal: int = signal.SIGTERM  # what asks it to stop (haproxy: a soft stop)


def executor_ports(settings: ServeSettings) -> dict[str, int]:
    """Executor module -> its gRPC port."""
    modules = EXECUTOR_MODULES[settings.executor]
    return {module: settings.executor_port + i for i, module in enumerate(modules)}


def model_source_args(config: ModelSourceSettings) -> list[str]:
    """The flags that say where the model comes from (each ModelSourceSettings field that is
    set: the children read the same settings), as every child gets them."""
    args: list[str] = []
    for name in ModelSourceSettings.model_fields:
        value = getattr(config, name)
        args += [f"--{name.replace('_', '-')}", value] if value else []
    return args


def executor_children(settings: ServeSettings, config: ControllerConfig) -> list[Child]:
    """The executors to start (each fetches the model's weights itself: a Hub id's files
    land in one cache, downloaded once)."""
    children = []
    for module, port in executor_ports(settings).items():
        command = [sys.executable, "-m", module, *model_source_args(config)]
        command += ["--host", EXECUTOR_HOST, "--port", str(port)]
        if settings.executor_step_port:
            step_port = settings.executor_step_port + port - settings.executor_port
            command += ["--step-port", str(step_port)]
        command += shlex.split(settings.executor_args)
        if module == "executor_tpu":
            command += shlex.split(settings.tpu_args)
        children.append(Child(module, command))
    return children


def plan(argv: list[str]) -> tuple[list[Child], ControllerConfig]:
    """The children to start (executors first, then the controller(s), then haproxy when
    there are several) and the (first) controller's settings, checked before anything starts
    (a bad flag exits 2)."""
    settings, controller_args = load_settings(
        ServeSettings,
        argv,
        prog="tandem serve",
        description=DESCRIPTION,
        known_only=True,
        config_file=False,  # --config is the controller's
    )
    ports = executor_ports(settings).values()
    controller_args += [f"--executor={EXECUTOR_HOST}:{port}" for port in ports]
    config = ControllerConfig.load(
        controller_args, prog="tandem serve (controller flags)", defaults=CONTROLLER_DEFAULTS
    )
    executors = executor_children(settings, config)
    # The resolved model and host are passed on: the controller's own defaults differ.
    command = [sys.executable, "-m", "controller", *controller_args, "--model", config.model]
    if settings.controllers == 1:
        return [*executors, Child("controller", [*command, "--host", config.host])], config
    if config.ssl_certfile:
        print("tandem serve: --controllers > 1 serves plain HTTP behind haproxy", file=sys.stderr)
        raise SystemExit(2)
    return [*executors, *balanced_controllers(settings, config, command)], config


def balanced_controllers(
    settings: ServeSettings, config: ControllerConfig, command: list[str]
) -> list[Child]:
    """--controllers N > 1: N controllers on loopback, each listing all of them as peers and
    advertising its own address, then haproxy on --host:--port in front of them (its config
    written into the run folder and checked here, before anything starts)."""
    first = settings.controller_port or config.port + 1
    addresses = [f"{EXECUTOR_HOST}:{first + i}" for i in range(settings.controllers)]
    peers = [f"--peer={address}" for address in addresses]
    controllers = [
        Child(
            f"controller{i}",
            [*command, "--host", EXECUTOR_HOST, "--port", str(first + i)]
            + [*peers, f"--advertise-address={address}"],
        )
        for i, address in enumerate(addresses)
    ]
    run_dir = settings.run_dir or tempfile.mkdtemp(prefix="tandem-fleet-")
    options = BalancerOptions(
        bind=f"{config.host}:{config.port}",
        backends=[Backend(child.name, a) for child, a in zip(controllers, addresses)],
        stats_socket=balancer.stats_socket(run_dir),
        # A soft stop outlasts the controllers' own drain, then cuts what is left before
        # stop_all's SIGKILL would.
        hard_stop_s=int(config.shutdown_grace) + 10,
    )
    config_path = balancer.write_config(run_dir, options)
    haproxy = Child("haproxy", balancer.command(config_path), stop_signal=balancer.STOP_SIGNAL)
    return [*controllers, haproxy]


def stop_all(children: list[Child], timeout: float) -> None:
    """Its stop signal to every running child, the last started first (haproxy, then the
    controllers, which drain; then the executors); SIGKILL what outlives timeout."""
    for child in reversed(children):
        if child.process is not None and child.process.poll() is None:
            child.process.send_signal(child.stop_signal)
    deadline = time.monotonic() + timeout
    for child in children:
        if child.process is None:
            continue
        try:
            child.process.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def supervise(children: list[Child], stop: threading.Event) -> int:
    """Start the children and watch them until ``stop`` is set (status 0) or one exits
    (status: its own, 1 if that was 0)."""
    for child in children:
        if stop.is_set():
            return 0
        child.process = subprocess.Popen(child.command)
    while not stop.wait(POLL_SECONDS):
        for child in children:
            code = child.process.poll()
            if code is not None:
                print(f"tandem serve: {child.name} exited with status {code}", file=sys.stderr)
                return code or 1
    return 0


def main(argv: list[str]) -> int:
    """Run `tandem serve` with ``argv``; its exit status."""
    children, config = plan(argv)
    if config.model == default_model.DEFAULT_MODEL_DIR and not default_model.is_complete(
        config.model
    ):
        print(f"tandem serve: preparing the default model in {config.model}", file=sys.stderr)
        default_model.prepare(config.model)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    scheme = "https" if config.ssl_certfile else "http"
    count = sum(child.name.startswith("controller") for child in children)
    front = f"{count} controllers behind haproxy" if count > 1 else "controller"
    print(f"tandem serve: {front} on {scheme}://{config.host}:{config.port}", file=sys.stderr)
    if count > 1:
        print(f"tandem serve: haproxy's config: {children[-1].command[-1]}", file=sys.stderr)
    try:
        return supervise(children, stop)
    finally:
        stop_all(children, config.shutdown_grace + 15.0)
