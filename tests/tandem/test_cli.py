"""The `tandem` command (in-process where it can be): its script entry in pyproject, the
dispatch to each program, `tandem serve`'s plan of children, and `tandem bench`."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest

from tandem import bench, cli, serve
from tandem import model as default_model
from tests.support.balancer import require_haproxy
from tests.support.processes import ROOT


def run(argv: list[str]) -> int:
    """`tandem ARGV` in this process: its exit status (SystemExit included)."""
    try:
        return cli.main(argv)
    except SystemExit as e:
        return e.code


def test_pyproject_declares_the_command_and_its_package():
    project = tomllib.loads((Path(ROOT) / "pyproject.toml").read_text())
    assert project["project"]["scripts"]["tandem"] == "tandem.cli:main"
    assert "tandem*" in project["tool"]["setuptools"]["packages"]["find"]["include"]
    deps = " ".join(project["project"]["dependencies"])
    assert "pydantic-settings" in deps and "pyyaml" in deps  # every program reads settings


def test_usage_and_unknown_commands(capsys):
    assert run(["--help"]) == 0 and "tandem COMMAND" in capsys.readouterr().out
    assert run([]) == 2
    assert run(["deploy"]) == 2 and "unknown command 'deploy'" in capsys.readouterr().err
    assert run(["executor"]) == 2
    assert run(["executor", "npu"]) == 2 and "gpu, tpu, sim" in capsys.readouterr().err


def test_programs_take_their_own_flags(capsys):
    assert run(["controller", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem controller") and "--executor-limits" in out
    assert run(["executor", "sim", "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: tandem executor sim") and "--step-fixed-ms" in out
    assert run(["executor", "gpu", "--model", "m", "--dtype", "fp8"]) == 2
    assert "argument --dtype" in capsys.readouterr().err


def test_serve_plans_executors_then_the_controller():
    children, config = serve.plan(
        [
            "--executor",
            "both",
            "--executor-port",
            "6000",
            "--executor-step-port",
            "6100",
            "--tpu-args=--token-buckets 32,128",
            "--executor-args=--kv-cache-bytes 1024",
            "--port",
            "9000",
            "--executor-limits",
            "tpu=64,8",
        ]
    )
    gpu, tpu, controller = children
    assert [c.name for c in children] == ["executor_gpu", "executor_tpu", "controller"]
    model = default_model.DEFAULT_MODEL_DIR  # no --model: the default one
    assert gpu.command[1:] == [
        "-m",
        "executor_gpu",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        "6000",
        "--step-port",
        "6100",
        "--kv-cache-bytes",
        "1024",
    ]
    assert tpu.command[-7:-4] == ["6001", "--step-port", "6101"]
    assert tpu.command[-4:] == ["--kv-cache-bytes", "1024", "--token-buckets", "32,128"]
    assert controller.command[1:3] == ["-m", "controller"]
    assert "--executor-limits" in controller.command  # what serve does not know goes on
    assert config.executors == ["127.0.0.1:6000", "127.0.0.1:6001"]
    assert (config.host, config.port, config.model) == ("127.0.0.1", 9000, model)
    assert config.kind_limits == {"tpu": (64, 8)}


def test_serve_model_host_and_variables(monkeypatch):
    monkeypatch.setenv("TANDEM_EXECUTOR", "tpu")
    monkeypatch.setenv("TANDEM_EXECUTOR_PORT", "7000")
    children, config = serve.plan(["--model", "/m/x", "--host", "0.0.0.0"])
    assert [c.name for c in children] == ["executor_tpu", "controller"]
    assert config.model == "/m/x" and config.host == "0.0.0.0"
    assert children[0].command[children[0].command.index("--model") + 1] == "/m/x"
    assert config.executors == ["127.0.0.1:7000"]


def test_serve_passes_the_model_source_to_every_child():
    """A Hub id and where it comes from reach the executors as well as the controller: each
    fetches what it reads into the same cache."""
    source = ["--model", "Org/Model", "--revision", "v1.0", "--download-dir", "/hub"]
    source += ["--hf-token-file", "/run/token"]
    children, config = serve.plan(["--executor", "both", *source])
    assert config.served_model_name == "Org/Model"
    for child in children:
        for flag, value in zip(source[::2], source[1::2]):
            assert child.command[child.command.index(flag) + 1] == value, child.name
    (gpu, *_), _ = serve.plan(["--model", "Org/Model"])
    assert "--revision" not in gpu.command and "--download-dir" not in gpu.command


def test_serve_plans_several_controllers_behind_haproxy(tmp_path, capsys):
    require_haproxy()
    argv = ["--controllers", "2", "--port", "9000", "--host", "0.0.0.0"]
    children, config = serve.plan([*argv, "--run-dir", str(tmp_path)])
    names = [c.name for c in children]
    assert names == ["executor_gpu", "controller0", "controller1", "haproxy"]
    peers = ["--peer=127.0.0.1:9001", "--peer=127.0.0.1:9002"]
    for i, child in enumerate(children[1:3]):
        port = str(9001 + i)
        tail = [
            "--host",
            "127.0.0.1",
            "--port",
            port,
            *peers,
            f"--advertise-address=127.0.0.1:{port}",
        ]
        assert child.command[-len(tail) :] == tail
    haproxy = children[-1]
    assert haproxy.stop_signal == signal.SIGUSR1  # a soft stop: streams end first
    cfg = (tmp_path / "haproxy.cfg").read_text()
    assert haproxy.command[-2:] == ["-f", str(tmp_path / "haproxy.cfg")]
    assert "bind 0.0.0.0:9000" in cfg and "server controller1 127.0.0.1:9002 check" in cfg
    children, _ = serve.plan([*argv, "--controller-port", "7000", "--run-dir", str(tmp_path)])
    assert "--advertise-address=127.0.0.1:7001" in children[2].command
    assert [c.name for c in serve.plan([])[0]] == ["executor_gpu", "controller"]  # 1: as before
    with pytest.raises(SystemExit) as exc:  # haproxy in front speaks plain HTTP to them
        serve.plan([*argv, "--ssl-certfile", "/c.pem", "--ssl-keyfile", "/k.pem"])
    assert exc.value.code == 2 and "plain HTTP behind haproxy" in capsys.readouterr().err


def test_serve_refuses_bad_flags_before_starting_anything(capsys):
    with pytest.raises(SystemExit) as exc:
        serve.plan(["--executor", "npu"])
    assert exc.value.code == 2 and "argument --executor" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        serve.plan(["--max-num-seqs", "many"])
    assert exc.value.code == 2 and "argument --max-num-seqs" in capsys.readouterr().err


def test_serve_stops_children_and_reports_a_dead_one():
    sleeper = serve.Child("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"])
    failing = serve.Child("failing", [sys.executable, "-c", "raise SystemExit(3)"])
    children = [sleeper, failing]
    try:
        assert serve.supervise(children, threading.Event()) == 3
    finally:
        serve.stop_all(children, timeout=10)
    assert sleeper.process.returncode is not None  # stopped


def test_bench_lists_and_runs_the_checkout_benchmarks(capsys, tmp_path):
    assert run(["bench"]) == 0
    out = capsys.readouterr().out
    assert "serve" in out and "controlplane" in out
    assert run(["bench", "nope"]) == 2 and "no benchmark 'nope'" in capsys.readouterr().err
    assert bench.main([], root=tmp_path) == 2  # outside a checkout
    assert "source checkout" in capsys.readouterr().err
    (tmp_path / "pyproject.toml").write_text("")
    (tmp_path / "benchmarks").mkdir()
    (tmp_path / "benchmarks" / "echo.py").write_text('"""Echo."""\nimport sys\nsys.exit(5)\n')
    assert bench.main([], root=tmp_path) == 0 and "echo  Echo." in capsys.readouterr().out
    assert bench.main(["echo"], root=tmp_path) == 5


def test_python_m_tandem_and_the_makefile():
    out = subprocess.run(
        [sys.executable, "-m", "tandem", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "compare" in out
    makefile = (Path(ROOT) / "Makefile").read_text()
    assert "-m tandem serve" in makefile and "-m tandem.model" in makefile
    assert not list((Path(ROOT) / "scripts").glob("run_*.sh"))


def test_default_model_completeness(tmp_path):
    assert not default_model.is_complete(str(tmp_path))
    for name in default_model.REQUIRED:
        (tmp_path / name).write_text("{}")
    assert default_model.is_complete(str(tmp_path))
    assert default_model.prepare(str(tmp_path)) is False  # there already: nothing to do
