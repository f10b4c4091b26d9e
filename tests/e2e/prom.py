"""A real Prometheus server and promtool for the metrics tests (Debian's `prometheus` package,
installed by scripts/install_prometheus.sh)."""

from __future__ import annotations

import os
import shutil
import subprocess
import time

import httpx

from tests.support.processes import free_port

# What promtool's linter reports on purpose: vLLM's metric names carry a colon (reserved for
# recording rules by convention) so that dashboards, KEDA triggers and endpoint pickers written
# for vLLM work unchanged, our `tandem:` names follow them, and vLLM's iteration-tokens histogram
# is named `vllm:iteration_tokens_total`. Anything else promtool says is a failure.
ALLOWED_LINT = (
    "metric names should not contain ':'",
    'vllm:iteration_tokens_total non-counter metrics should not have "_total" suffix',
)


def require_prometheus() -> None:
    """Install the package if missing (what `make test` does before the suite)."""
    if shutil.which("prometheus") and shutil.which("promtool"):
        return
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run(["bash", os.path.join(root, "scripts/install_prometheus.sh")], check=True)


def promtool_problems(exposition: str) -> list[str]:
    """promtool check metrics on one exposition: the problems it reports, minus the allowed
    ones; a parse error is returned as a problem."""
    require_prometheus()
    proc = subprocess.run(
        ["promtool", "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=60,
    )
    if proc.returncode not in (0, 3):  # 3: lint problems only; anything else: unparsable
        return [f"promtool failed ({proc.returncode}): {proc.stderr or proc.stdout}"]
    lines = [ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    return [ln for ln in lines if not any(ln.endswith(a) for a in ALLOWED_LINT)]


class PrometheusServer:
    """A Prometheus server scraping the given targets every second."""

    def __init__(self, tmp_dir: str, jobs: dict[str, list[str]]):
        require_prometheus()
        self.port = free_port()  # HTTP API port
        self.url = f"http://127.0.0.1:{self.port}"
        config = os.path.join(tmp_dir, "prometheus.yml")
        with open(config, "w") as f:
            f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n")
            for job, targets in jobs.items():
                f.write(
                    f"  - job_name: {job}\n    static_configs:\n"
                    f"      - targets: [{', '.join(repr(t) for t in targets)}]\n"
                )
        self.log_path = os.path.join(tmp_dir, "prometheus.log")
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={os.path.join(tmp_dir, 'tsdb')}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=open(self.log_path, "w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.time() + 60
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError("prometheus did not start:\n" + open(self.log_path).read())
            time.sleep(0.3)

    def query(self, expr: str) -> list[dict]:
        """An instant query's result vector (raises on a query error)."""
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        if body.get("status") != "success":
            raise AssertionError(f"{expr}: {body}")
        return body["data"]["result"]

    def targets_up(self) -> dict[str, bool]:
        """Each scrape target's health."""
        r = httpx.get(self.url + "/api/v1/targets", timeout=10).json()
        return {t["scrapeUrl"]: t["health"] == "up" for t in r["data"]["activeTargets"]}

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
