"""haproxy as a child process: its config written into a run folder and checked, its command
line (foreground, no daemon, no system service), and its servers' states read back.

`tandem serve --controllers N` starts it through here; the several-controllers tests do too.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess

from tandem.haproxy_config import BalancerOptions, render

CONFIG_NAME = "haproxy.cfg"
SOCKET_NAME = "haproxy.sock"
# haproxy's soft stop: stop listening, let open connections end (bounded by hard-stop-after).
# SIGTERM would cut every stream at once, before the controllers could drain them.
STOP_SIGNAL = signal.SIGUSR1
INSTALL_HINT = "haproxy not found: `make lb-deps` (scripts/install_haproxy.sh) installs it"


def haproxy_binary() -> str:
    """The haproxy on PATH; RuntimeError naming the way to install it when there is none."""
    path = shutil.which("haproxy")
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


def write_config(run_dir: str, options: BalancerOptions) -> str:
    """Write ``options`` as run_dir/haproxy.cfg and check it with `haproxy -c` (a
    RuntimeError with haproxy's words when it is refused); its path."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, CONFIG_NAME)
    with open(path, "w") as f:
        f.write(render(options))
    check = subprocess.run(
        [haproxy_binary(), "-c", "-q", "-f", path], capture_output=True, text=True, timeout=30
    )
    if check.returncode != 0:
        raise RuntimeError(f"haproxy refused {path}:\n{check.stdout}{check.stderr}")
    return path


def command(config_path: str) -> list[str]:
    """haproxy's command line: -db keeps it in the foreground as the launcher's child (no
    daemon, no fork), so it stops with the launcher and its log reaches the launcher's
    stderr; -W would add a master process, which nothing here needs."""
    return [haproxy_binary(), "-db", "-f", config_path]


def stats_socket(run_dir: str) -> str:
    """Where the run folder's haproxy answers admin commands."""
    return os.path.join(run_dir, SOCKET_NAME)


def stat_rows(socket_path: str, timeout: float = 2.0) -> list[dict[str, str]]:
    """haproxy's `show stat` on its admin socket: one row per frontend, backend and server,
    keyed by the CSV header's names (svname, status, wretr, wredis, ...)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(socket_path)
        sock.sendall(b"show stat\n")
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    lines = [line for line in b"".join(chunks).decode().splitlines() if line]
    header = lines[0].lstrip("# ").split(",")
    return [dict(zip(header, line.split(","))) for line in lines[1:]]


def server_states(socket_path: str, timeout: float = 2.0) -> dict[str, str]:
    """Each controller's state as haproxy sees it now (server name -> "UP", "DOWN",
    "UP 1/2", "NOLB", ...)."""
    rows = stat_rows(socket_path, timeout)
    return {r["svname"]: r["status"] for r in rows if r.get("type") == "2"}  # 2: a server
