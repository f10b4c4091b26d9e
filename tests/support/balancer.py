"""haproxy for the tests, through the launcher's own module (tandem/balancer.py): installed if
missing (what `make test` does first), started in front of given addresses, its view of each
server read back."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass

from tandem import balancer
from tandem.haproxy_config import Backend, BalancerOptions
from tests.support.processes import ROOT, free_port, wait_until


def require_haproxy() -> None:
    """Install Debian's haproxy if it is not on PATH (scripts/install_haproxy.sh)."""
    if shutil.which("haproxy"):
        return
    subprocess.run(["bash", os.path.join(ROOT, "scripts/install_haproxy.sh")], check=True)


@dataclass
class LiveBalancer:
    """A haproxy process in front of named servers."""

    process: subprocess.Popen  # haproxy -db
    base_url: str  # http://127.0.0.1:PORT, what clients reach
    socket_path: str  # its admin socket

    def states(self) -> dict[str, str]:
        """Server name -> UP / DOWN ... as haproxy sees it now."""
        return balancer.server_states(self.socket_path)

    def stats(self) -> list[dict[str, str]]:
        """`show stat` rows (frontend, backend, each server)."""
        return balancer.stat_rows(self.socket_path)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)  # a hard stop: the test is over
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_balancer(run_dir: str, servers: dict[str, str], **options) -> LiveBalancer:
    """haproxy on a free port in front of ``servers`` (name -> host:port), with the launcher's
    config (``options``: BalancerOptions fields to change); returns once it listens."""
    require_haproxy()
    port = free_port()
    config = BalancerOptions(
        bind=f"127.0.0.1:{port}",
        backends=[Backend(name, address) for name, address in servers.items()],
        stats_socket=balancer.stats_socket(run_dir),
        **options,
    )
    path = balancer.write_config(run_dir, config)
    log = open(os.path.join(run_dir, "haproxy.log"), "w")
    process = subprocess.Popen(
        balancer.command(path), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    live = LiveBalancer(process, f"http://127.0.0.1:{port}", config.stats_socket)
    wait_until(lambda: os.path.exists(config.stats_socket) and live.states(), 30, "haproxy")
    return live
