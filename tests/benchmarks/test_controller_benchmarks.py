"""The several-controllers benchmarks run: controlplane.py with --controllers 1,2 on a tiny grid
(ratios printed), and prefix_affinity.py on a tiny workload, where cross-controller affinity
brings the fleet-wide hit rate of two controllers back to one controller's."""

from __future__ import annotations

import json
import os

from tests.benchmarks.test_benchmarks import run_script


def _logs(path) -> str:
    return "".join(open(os.path.join(path, f)).read()[-2000:] for f in os.listdir(path))


def test_controlplane_with_two_controllers(default_model_dir, tmp_path):
    out, logs = tmp_path / "cp.json", tmp_path / "logs"
    args = ["--running", "16", "--executors", "2", "--controllers", "1,2", "--window", "1.5"]
    args += ["--settle", "0.3", "--output-len", "512", "--json", str(out), "--log-dir", str(logs)]
    proc = run_script(["benchmarks/controlplane.py", "--model", default_model_dir, *args], 240)
    assert proc.returncode == 0, proc.stderr + _logs(logs)
    one, two = json.loads(out.read_text())["points"]
    assert (one["controllers"], two["controllers"]) == (1, 2)
    assert two["steps_per_s"] > 0 and 0 < two["busy_fraction"] <= 1.0
    assert "ratios to one controller" in proc.stdout


def test_prefix_affinity_restores_the_hit_rate(default_model_dir, tmp_path):
    out, logs = tmp_path / "prefix.json", tmp_path / "logs"
    args = ["--groups", "7", "--group-size", "3", "--prefix-len", "256", "--hot-requests", "8"]
    args += ["--concurrency", "4", "--json", str(out), "--log-dir", str(logs)]
    proc = run_script(["benchmarks/prefix_affinity.py", "--model", default_model_dir, *args], 300)
    assert proc.returncode == 0, proc.stderr + _logs(logs)
    one, apart, together = json.loads(out.read_text())["results"]
    ideal = 2 / 3 * 256 / (256 + 32)  # every group's later requests hit its whole prefix
    assert abs(one["hit_rate"] - ideal) < 0.02
    assert apart["hit_rate"] < ideal - 0.1  # half of a group's requests on the other one
    assert abs(together["hit_rate"] - ideal) < 0.02 and together["forwarded"] > 0
