"""Control-plane cost: how busy the controller keeps simulated devices, and what it spends.

For each point of a grid (running requests x executors) this starts N simulated executors
(`python -m executor_sim`, one process each, with a Prometheus port) and a controller in front
of them, keeps R long requests in flight (closed loop: a finished one is replaced; non-streamed,
or with --stream SSE streams read as they come; the load generator runs in a process of its own,
benchmarks/loadgen.py, whose CPU is reported apart), waits until all R run, then measures over a
steady window:

- device busy fraction: the executors' busy seconds / (N x wall seconds) (from the sims), and
  the "ideal" share the latency model alone accounts for (busy exceeds it when the simulators
  themselves wait for a core on a loaded machine);
- controller CPU per step and per generated token: its utime + stime (/proc/PID/stat) over the
  window, divided by the steps and sampled tokens the sims counted; also the share of the
  window its event loop waited for a core (/proc/PID/task/PID/schedstat): high on a crowded
  machine, where the step rate says more about the machine than about the controller;
- gRPC bytes per request per decode step: StepRequest bytes of pure decode steps / the
  requests they scheduled.

    python benchmarks/controlplane.py --running 16,64,256 --executors 1,4,16 --json cp.json
    python benchmarks/controlplane.py --running 64,256 --executors 1,4 --stream both

With `--controllers 1,2,4` each point runs with that many controllers as peers dividing the
executors (benchmarks/multi_controller.py); the load generator spreads its requests over them
round robin, CPU figures are summed over them, and a last table gives each point's steps/s and
busy fraction as ratios to one controller.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.loadgen import LoadProcess, LoadSpec  # noqa: E402
from benchmarks.multi_controller import (  # noqa: E402
    fleet_state_all,
    owned_states,
    start_controllers,
    stop_all,
    wait_divided,
)
from common.wire.model_config import load_model_geometry  # noqa: E402
from tests.support.processes import (  # noqa: E402
    LiveServer,
    executor_command,
    free_port,
    model_dir,
    read_ports_files,
    spawn_process,
    wait_until,
)

SIM_COUNTERS = (
    "busy_seconds",
    "modeled_seconds",
    "steps",
    "sampled_tokens",
    "scheduled_requests",
    "step_request_bytes",
    "decode_steps",
    "decode_step_request_bytes",
    "decode_scheduled_requests",
)


@dataclass
class PointResult:
    """What one grid point measured over its steady window."""

    executors: int  # simulated executors
    running: int  # requests kept in flight
    stream: bool  # the load generator's requests were streamed (SSE)
    window_s: float  # wall seconds measured
    busy_fraction: float  # executor busy seconds / (executors x window)
    modeled_fraction: float  # modeled step seconds / (executors x window): the ideal busy part
    steps_per_s: float  # steps per second, all executors together
    tokens_per_s: float  # sampled tokens per second, all executors together
    batch_per_step: float  # scheduled requests per step
    controller_cpu_util: float  # controller CPU seconds per wall second (1.0 = one core)
    controller_wait_frac: float  # share of the window its event loop waited for a free core
    cpu_ms_per_step: float  # controller CPU milliseconds per step
    cpu_us_per_token: float  # controller CPU microseconds per generated token
    bytes_per_request_decode: float  # StepRequest bytes per request in pure decode steps
    bytes_per_request_all: float  # StepRequest bytes per scheduled request, every step
    running_at_end: int  # requests the controller reported running after the window
    controllers: int = 1  # controllers dividing the executors (CPU figures: their sum)
    load_cpu_util: float = 0.0  # the load generator's CPU seconds per wall second (own process)
    load_us_per_token: float = 0.0  # the load generator's CPU microseconds per generated token
    # Kernel time's share of the controller's CPU: its socket writes (on loopback the kernel
    # runs the receiver's TCP path inside the sender's call) and its gRPC calls.
    controller_sys_share: float = 0.0
    stream_writers: int = 0  # the controller's --stream-writers
    writer_cpu_util: float = 0.0  # the stream writer processes' CPU / wall seconds, summed
    writer_us_per_token: float = 0.0  # their CPU microseconds per sampled token
    transport: str = "grpc"  # how steps went: "grpc" (ExecuteModel) or "socket" (--step-port)


def cpu_times(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    return sum(cpu_times(pid))


def writer_pids(controller_pids: list[int]) -> list[int]:
    """The stream writer processes the controllers started (--stream-writers)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            if ppid not in controller_pids:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if b"controller.api.writers.worker" in f.read():
                    pids.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return pids


def run_queue_seconds(pid: int) -> float:
    """Seconds the process's main thread has spent runnable but waiting for a core (a busy
    machine shows here, not in the CPU time)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):  # no schedstats in this kernel
        return 0.0


def scrape_sim(client: httpx.Client, port: int) -> dict[str, float]:
    """The tandem_sim:* counters of one simulated executor, without prefix and _total."""
    values = {}
    for line in client.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith("tandem_sim:"):
            name, _, value = line.partition(" ")
            values[name[len("tandem_sim:") :].removesuffix("_total")] = float(value)
    return values


def snapshot(
    client: httpx.Client, ports: list[int], controller_pids: list[int], load_pid: int
) -> dict[str, float]:
    """Wall time, the controllers' CPU (summed), the load generator's CPU and the sims'
    counters summed over executors."""
    totals = dict.fromkeys(SIM_COUNTERS, 0.0)
    for port in ports:
        for name, value in scrape_sim(client, port).items():
            if name in totals:
                totals[name] += value
    totals["cpu"] = sum(cpu_seconds(pid) for pid in controller_pids)
    totals["sys_cpu"] = sum(cpu_times(pid)[1] for pid in controller_pids)
    totals["runq"] = sum(run_queue_seconds(pid) for pid in controller_pids)
    totals["load_cpu"] = cpu_seconds(load_pid)
    totals["writer_cpu"] = sum(cpu_seconds(pid) for pid in writer_pids(controller_pids))
    totals["wall"] = time.perf_counter()
    return totals


def measure(
    before: dict,
    after: dict,
    executors: int,
    running: int,
    running_at_end: int,
    stream: bool,
    controllers: int = 1,
    writers: int = 0,
) -> PointResult:
    """The PointResult of the window between two snapshots."""
    d = {k: after[k] - before[k] for k in before}
    wall, steps, tokens = d["wall"], max(d["steps"], 1.0), max(d["sampled_tokens"], 1.0)
    return PointResult(
        executors=executors,
        running=running,
        stream=stream,
        window_s=wall,
        busy_fraction=d["busy_seconds"] / (executors * wall),
        modeled_fraction=d["modeled_seconds"] / (executors * wall),
        steps_per_s=d["steps"] / wall,
        tokens_per_s=d["sampled_tokens"] / wall,
        batch_per_step=d["scheduled_requests"] / steps,
        controller_cpu_util=d["cpu"] / wall,
        controller_wait_frac=d["runq"] / wall,
        cpu_ms_per_step=1e3 * d["cpu"] / steps,
        cpu_us_per_token=1e6 * d["cpu"] / tokens,
        bytes_per_request_decode=d["decode_step_request_bytes"]
        / max(d["decode_scheduled_requests"], 1.0),
        bytes_per_request_all=d["step_request_bytes"] / max(d["scheduled_requests"], 1.0),
        running_at_end=running_at_end,
        controllers=controllers,
        load_cpu_util=d["load_cpu"] / wall,
        load_us_per_token=1e6 * d["load_cpu"] / tokens,
        controller_sys_share=d.get("sys_cpu", 0.0) / max(d["cpu"], 1e-9),
        stream_writers=writers,
        writer_cpu_util=d.get("writer_cpu", 0.0) / wall,
        writer_us_per_token=1e6 * d.get("writer_cpu", 0.0) / tokens,
    )


def free_port_range(count: int) -> int:
    """The first of `count` consecutive ports free now (a sim process's step sockets)."""
    for _ in range(100):
        first = free_port()
        if all(_port_free(first + i) for i in range(1, count)):
            return first
    raise RuntimeError(f"no {count} consecutive free ports")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def controller_args(
    a: argparse.Namespace, ports: list[int], running: int, writers: int = 0, transport: str = ""
) -> list[str]:
    """Controller flags for one point: room for every request in a step and in the KV pool."""
    executors = len(ports)
    per_executor = math.ceil(running / executors * 1.25) + 4
    blocks = per_executor * math.ceil((a.input_len + a.output_len + 1) / 16) + 64
    args = [
        "--max-num-seqs",
        str(max(running, 16)),
        "--max-num-batched-tokens",
        str(max(2048, running)),
        "--num-kv-blocks",
        str(blocks),
        "--max-queued-requests",
        "0",
        "--log-level",
        "WARNING",
    ]
    for port in ports:
        args += ["--executor", f"127.0.0.1:{port}"]
    if writers:
        args += ["--stream-writers", str(writers)]
    if transport == "grpc" and "socket" in a.transports:  # the sims offer one: not taken
        args += ["--no-executor-step-socket"]
    return args + a.controller_args.split()


def run_point(
    a: argparse.Namespace,
    tmp: str,
    ports: list[int],
    metric_ports: list[int],
    running: int,
    vocab: int,
    stream: bool = False,
    controllers: int = 1,
    writers: int = 0,
    transport: str = "grpc",
) -> PointResult:
    """Start the controllers on the running sims, load them, measure the window, stop them."""
    name = f"controller-{len(ports)}x{running}x{controllers}{'-stream' if stream else ''}w{writers}"
    name += f"-{transport}"
    args = controller_args(a, ports, running, writers, transport)
    servers = start_controllers(a.model, tmp, args, controllers, name)
    try:
        wait_divided(servers, len(ports), a.settle_timeout, tmp)
        spec = LoadSpec(
            [s.base_url for s in servers],
            servers[0].model_name,
            running,
            a.input_len,
            a.output_len,
            vocab,
            stream,
        )
        point = drive(a, servers, spec, len(ports), metric_ports, tmp)
        took = {e["step_transport"] for s in servers for e in owned_states(s)}
        if took != {transport}:  # e.g. a step socket the controller could not reach
            raise RuntimeError(f"steps went over {sorted(took)}, not {transport}")
        return replace(point, stream_writers=writers, transport=transport)
    finally:
        stop_all(servers)


def drive(
    a: argparse.Namespace,
    servers: list[LiveServer],
    spec: LoadSpec,
    executors: int,
    metric_ports: list[int],
    tmp: str,
) -> PointResult:
    """Load the controllers from a process of its own, wait until every request runs, measure
    the window (optionally under py-spy: the first controller)."""
    load = LoadProcess(spec)

    def steady() -> bool:
        _, now_running, waiting = fleet_state_all(servers)
        return now_running >= spec.running and waiting == 0

    try:
        wait_until(steady, a.settle_timeout, f"{spec.running} running requests", 0.25, tmp)
        time.sleep(a.settle)
        spy = start_py_spy(a, servers[0].controller.pid, executors, spec)
        with httpx.Client() as client:
            pids = [s.controller.pid for s in servers]
            before = snapshot(client, metric_ports, pids, load.pid)
            time.sleep(a.window)
            after = snapshot(client, metric_ports, pids, load.pid)
        if spy is not None:
            spy.wait()
        _, at_end, _ = fleet_state_all(servers)
    finally:
        load.stop()
    return measure(before, after, executors, spec.running, at_end, spec.stream, len(servers))


def start_py_spy(a: argparse.Namespace, pid: int, executors: int, spec: LoadSpec):
    """With --py-spy DIR: record the controller over the window (collapsed stacks per point,
    with native frames: `flamegraph.pl` or speedscope read them); the process, or None."""
    if not a.py_spy:
        return None
    os.makedirs(a.py_spy, exist_ok=True)
    kind = "stream" if spec.stream else "whole"
    out = os.path.join(a.py_spy, f"controller-{executors}x{spec.running}-{kind}.txt")
    exe = os.path.join(os.path.dirname(sys.executable), "py-spy")
    cmd = [
        exe if os.path.exists(exe) else "py-spy",
        "record",
        "--pid",
        str(pid),
        "--duration",
        str(int(a.window)),
    ]
    cmd += ["--rate", "200", "--nonblocking", "--format", "raw", "-o", out]
    log = open(out + ".log", "w")  # noqa: SIM115 (the child owns it)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)


def start_sims(a: argparse.Namespace, tmp: str, count: int) -> tuple[list, list[int], list[int]]:
    """Start `count` simulated executors, up to --sims-per-process in each process; return
    (processes, gRPC ports, metrics ports: one per process, counters summed over its sims)."""
    procs, ports_files, metric_ports = [], [], []
    for i, first in enumerate(range(0, count, a.sims_per_process)):
        metrics_port = free_port()
        ports_file = os.path.join(tmp, f"sim{count}-{i}.ports")
        extra = [
            "--metrics-port",
            str(metrics_port),
            "--num-blocks",
            "16",
            "--step-fixed-ms",
            str(a.step_fixed_ms),
            "--step-per-token-us",
            str(a.step_per_token_us),
            "--step-per-request-us",
            str(a.step_per_request_us),
            "--count",
            str(min(a.sims_per_process, count - first)),
            "--ports-file",
            ports_file,
            "--seed",
            str(first),
            "--log-level",
            "WARNING",
        ]
        if "socket" in a.transports:  # the sims offer a step socket; "grpc" points ignore it
            extra += ["--step-port", str(free_port_range(count))]
        procs.append(
            spawn_process(
                executor_command("executor_sim", a.model, 0, extra),
                os.path.join(tmp, f"sim{count}-{i}.log"),
            )
        )
        ports_files.append(ports_file)
        metric_ports.append(metrics_port)
    ports = read_ports_files(ports_files, 120, logs=tmp)
    with httpx.Client() as client:
        for port in metric_ports:
            wait_until(
                lambda p=port: scrape_sim(client, p), 120, f"sim metrics on :{port}", logs=tmp
            )
    return procs, ports, metric_ports


def stop_processes(procs: list) -> None:
    """SIGTERM, then SIGKILL what is still up after 10 s."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + 10
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except Exception:
            p.kill()
            p.wait()


def format_table(points: list[PointResult]) -> str:
    """The results as an aligned text table."""
    head = (
        f"{'ctls':>4} {'execs':>5} {'running':>7} {'mode':>6} {'busy%':>6} {'ideal%':>6} "
        f"{'steps/s':>8} "
        f"{'tok/s':>8} {'batch':>6} {'ctl_cpu%':>8} {'ctl_wait%':>9} {'cpu_ms/step':>11} "
        f"{'cpu_us/tok':>10} {'B/req/decode':>12} {'load_cpu%':>9} {'load_us/tok':>11} "
        f"{'ctl_sys%':>8} {'writers':>7} {'wr_cpu%':>7} {'wr_us/tok':>9} {'steps':>6}"
    )
    rows = [head]
    for p in points:
        rows.append(
            f"{p.controllers:>4} {p.executors:>5} {p.running:>7} "
            f"{'stream' if p.stream else 'whole':>6} {100 * p.busy_fraction:>6.1f} "
            f"{100 * p.modeled_fraction:>6.1f} {p.steps_per_s:>8.1f} {p.tokens_per_s:>8.0f} "
            f"{p.batch_per_step:>6.1f} {100 * p.controller_cpu_util:>8.1f} "
            f"{100 * p.controller_wait_frac:>9.1f} "
            f"{p.cpu_ms_per_step:>11.3f} {p.cpu_us_per_token:>10.1f} "
            f"{p.bytes_per_request_decode:>12.1f} {100 * p.load_cpu_util:>9.1f} "
            f"{p.load_us_per_token:>11.1f} {100 * p.controller_sys_share:>8.1f} "
            f"{p.stream_writers:>7} {100 * p.writer_cpu_util:>7.1f} {p.writer_us_per_token:>9.1f} "
            f"{p.transport:>6}"
        )
    return "\n".join(rows)


def format_ratios(points: list[PointResult]) -> str:
    """Each point's steps/s and busy fraction as ratios to the same point with one controller
    ("" when there is none, or only one controller was measured)."""
    ones = {(p.executors, p.running, p.stream): p for p in points if p.controllers == 1}
    rows = [f"{'ctls':>4} {'execs':>5} {'running':>7} {'steps/s x':>9} {'busy x':>7}"]
    for p in points:
        one = ones.get((p.executors, p.running, p.stream))
        if one is None or p.controllers == 1:
            continue
        steps = p.steps_per_s / max(one.steps_per_s, 1e-9)
        busy = p.busy_fraction / max(one.busy_fraction, 1e-9)
        rows.append(
            f"{p.controllers:>4} {p.executors:>5} {p.running:>7} {steps:>9.2f} {busy:>7.2f}"
        )
    return "\n".join(rows) if len(rows) > 1 else ""


def stream_modes(choice: str) -> list[bool]:
    """--stream's modes: streamed (True), non-streamed (False), or both, non-streamed first."""
    return {"no": [False], "yes": [True], "both": [False, True]}[choice]


def point_modes(a: argparse.Namespace) -> list[tuple[bool, int, str]]:
    """(streamed, stream writers, transport) per point: each --stream-writers count for
    streamed points (they write only streams), none for non-streamed ones; each of those with
    each --transports, in turn."""
    modes = []
    for stream in stream_modes(a.stream):
        for writers in a.stream_writers if stream else [0]:
            for transport in a.transports:
                modes.append((stream, writers, transport))
    return modes


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_dir(), help="HF model dir (tokenizer, geometry)")
    p.add_argument(
        "--running",
        type=_ints,
        default=[16, 64, 256],
        help="requests kept in flight, comma-separated (e.g. 16,64,256,1024)",
    )
    p.add_argument(
        "--executors",
        type=_ints,
        default=[1, 4, 16],
        help="simulated executors, comma-separated (e.g. 1,4,16,64)",
    )
    p.add_argument(
        "--controllers",
        type=_ints,
        default=[1],
        help="controllers dividing the executors, comma-separated (e.g. 1,2,4)",
    )
    p.add_argument("--window", type=float, default=5.0, help="seconds measured per point")
    p.add_argument(
        "--settle",
        type=float,
        default=1.0,
        help="seconds waited after every request runs, before the window",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=180.0,
        help="most seconds to wait for executors and for every request to run",
    )
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens")
    p.add_argument(
        "--output-len",
        type=int,
        default=2048,
        help="max tokens per request (long: requests keep running)",
    )
    p.add_argument(
        "--sims-per-process", type=int, default=16, help="simulated executors per simulator process"
    )
    p.add_argument("--step-fixed-ms", type=float, default=10.0, help="sim: ms per step")
    p.add_argument("--step-per-token-us", type=float, default=20.0, help="sim: us per token")
    p.add_argument("--step-per-request-us", type=float, default=0.0, help="sim: us per request")
    p.add_argument("--log-dir", default="", help="keep process logs here (default: temporary)")
    p.add_argument(
        "--controller-args", default="", help="extra controller flags, e.g. '--pipeline-depth 3'"
    )
    p.add_argument(
        "--stream",
        choices=["no", "yes", "both"],
        nargs="?",
        const="yes",
        default="no",
        help="the load generator's requests streamed (SSE, read as they come), or both modes",
    )
    p.add_argument(
        "--stream-writers",
        type=_ints,
        default=[0],
        help="the controller's --stream-writers for streamed points, comma-separated (e.g. 0,2)",
    )
    p.add_argument(
        "--transports",
        type=lambda text: [x for x in text.split(",") if x],
        default=["grpc"],
        help="how the controller sends steps, per point, comma-separated: grpc (ExecuteModel), "
        "socket (the sims' step socket, --step-port); e.g. grpc,socket,grpc,socket",
    )
    p.add_argument(
        "--py-spy", default="", help="record the controller with py-spy into this folder"
    )
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    vocab = load_model_geometry(a.model).vocab_size
    points: list[PointResult] = []
    with tempfile.TemporaryDirectory() as scratch:
        tmp = a.log_dir or scratch
        os.makedirs(tmp, exist_ok=True)
        for count in a.executors:
            procs, ports, metric_ports = start_sims(a, tmp, count)
            try:
                for running in a.running:
                    for controllers in a.controllers:
                        if running < count or count < controllers:
                            continue
                        for stream, writers, transport in point_modes(a):
                            point = run_point(
                                a,
                                tmp,
                                ports,
                                metric_ports,
                                running,
                                vocab,
                                stream,
                                controllers,
                                writers,
                                transport,
                            )
                            points.append(point)
                            print(
                                format_table([point]).splitlines()[-1], file=sys.stderr, flush=True
                            )
            finally:
                stop_processes(procs)
    print(format_table(points))
    ratios = format_ratios(points)
    if ratios:
        print("\nratios to one controller:\n" + ratios)
    if a.json:
        config = {k: v for k, v in vars(a).items() if k not in ("json", "log_dir")}
        with open(a.json, "w") as f:
            json.dump({"config": config, "points": [asdict(x) for x in points]}, f, indent=2)


if __name__ == "__main__":
    main()
