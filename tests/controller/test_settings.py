"""The controller's settings: every flag of before still works (same name, default, meaning),
vLLM's names are aliases, TANDEM_<FIELD> and --config set the same settings, precedence is
command line > environment > config file > default, and bad values exit 2 naming their flag."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from common.settings import fields
from controller.main import load_config
from controller.settings import ControllerConfig
from tests.support.legacy import legacy_flags, legacy_help_flags
from tests.support.processes import ROOT

MODEL = "/models/Some-Model"


@pytest.fixture(autouse=True)
def _no_api_key_variable(monkeypatch):
    monkeypatch.delenv("TANDEM_API_KEY", raising=False)  # load_api_keys reads os.environ
    monkeypatch.delenv("TANDEM_ADMIN_API_KEY", raising=False)


def load(argv: list[str], environ: dict | None = None, **kw) -> ControllerConfig:
    """Settings from argv and environ alone (not this process's environment)."""
    return ControllerConfig.load(argv, prog="controller", environ=environ or {}, **kw)


def bad(capsys, argv: list[str], environ: dict | None = None) -> str:
    """The message of a refused command line (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        load(argv, environ)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def files(tmp_path) -> dict[str, str]:
    keys = tmp_path / "keys"
    keys.write_text("# keys\nfile-key\n\n")
    token = tmp_path / "token"
    token.write_text("\nsecret-token\n")
    return {"keys": str(keys), "token": str(token), "hosts": str(tmp_path / "hosts")}


def flag_table(files: dict[str, str]) -> dict[str, tuple[str | None, str, object]]:
    """Old flag -> (a value, the field it sets, what the field then holds)."""
    return {
        "--affinity-max-wait": ("3.5", "affinity_max_wait", 3.5),
        "--api-key": ("flag-key", "api_keys", ["flag-key"]),
        "--api-key-file": (files["keys"], "api_keys", ["file-key"]),
        "--auth-exempt-path": ("/version", "auth_exempt_paths", ["/version"]),
        "--auth-token-file": (files["token"], "executor_token", "secret-token"),
        "--discovery-interval": ("5", "discovery_interval", 5.0),
        "--dns-server": ("10.0.0.2:53", "dns_server", "10.0.0.2:53"),
        "--executor": ("10.0.0.1:50051", "executors", ["10.0.0.1:50051"]),
        "--executor-dns": ("gpu.svc:50051", "executor_dns", ["gpu.svc:50051"]),
        "--executor-file": (files["hosts"], "executor_files", [files["hosts"]]),
        "--executor-limits": ("tpu=64,8", "kind_limits", {"tpu": (64, 8)}),
        "--executor-startup-timeout": ("60", "executor_startup_timeout", 60.0),
        "--executor-tls-ca": ("/tls/ca.crt", "executor_tls_ca", "/tls/ca.crt"),
        "--executor-tls-cert": ("/tls/c.crt", "executor_tls_cert", "/tls/c.crt"),
        "--executor-tls-key": ("/tls/c.key", "executor_tls_key", "/tls/c.key"),
        "--executor-tls-server-name": ("ex", "executor_tls_server_name", "ex"),
        "--health-check-failures": ("5", "health_check_failures", 5),
        "--health-check-interval": ("0.5", "health_check_interval", 0.5),
        "--health-check-timeout": ("4", "health_check_timeout", 4.0),
        "--host": ("127.0.0.1", "host", "127.0.0.1"),
        "--http-keep-alive": ("90", "http_keep_alive", 90.0),
        "--log-level": ("DEBUG", "log_level", "DEBUG"),
        "--long-prefill-token-threshold": ("256", "long_prefill_token_threshold", 256),
        "--max-logprobs": ("5", "max_logprobs", 5),
        "--max-model-len": ("4096", "max_model_len", 4096),
        "--max-num-batched-tokens": ("512", "max_num_batched_tokens", 512),
        "--max-num-seqs": ("16", "max_num_seqs", 16),
        "--max-queued-requests": ("7", "max_queued_requests", 7),
        "--max-queued-tokens": ("700", "max_queued_tokens", 700),
        "--max-request-bytes": ("1000", "max_request_bytes", 1000),
        "--model": ("/m/Other", "model", "/m/Other"),
        "--no-executor-timeout": ("9", "no_executor_timeout", 9.0),
        "--no-prefix-affinity": (None, "prefix_affinity", False),
        "--no-prefix-caching": (None, "enable_prefix_caching", False),
        "--num-kv-blocks": ("100", "num_kv_blocks", 100),
        "--pipeline-depth": ("4", "pipeline_depth", 4),
        "--policy": ("priority", "policy", "priority"),
        "--port": ("9000", "port", 9000),
        "--reconnect-backoff-max": ("3", "reconnect_backoff_max", 3.0),
        "--retry-after": ("2", "retry_after", 2),
        "--scheduler": ("my.mod:Sched", "scheduler_class", "my.mod:Sched"),
        "--seed": ("3", "seed", 3),
        "--served-model-name": ("chat", "served_model_name", "chat"),
        "--shutdown-grace": ("5", "shutdown_grace", 5.0),
        "--ssl-certfile": ("/tls/s.crt", "ssl_certfile", "/tls/s.crt"),
        "--ssl-keyfile": ("/tls/s.key", "ssl_keyfile", "/tls/s.key"),
        "--step-time-target": ("0.25", "step_time_target", 0.25),
        "--step-timeout": ("30", "step_timeout", 30.0),
    }


def test_every_old_flag_is_accepted(files):
    table = flag_table(files)
    assert set(table) == set(legacy_flags("controller"))  # the table covers every old flag
    for flag, (value, field, expected) in table.items():
        argv = ["--model", MODEL, flag] + ([] if value is None else [value])
        assert getattr(load(argv), field) == expected, flag


def test_old_defaults_are_kept():
    config = load(["--model", MODEL])
    # What a flag's absence meant before, where it is not the argparse default itself.
    effective = {
        "--served-model-name": "Some-Model",  # the model directory's basename
        "--executor": ["127.0.0.1:50051"],  # no --executor, --executor-dns or --executor-file
        "--auth-exempt-path": ["/health", "/metrics"],
        "--executor-limits": {},
        "--no-prefix-affinity": True,  # the field is the positive one
        "--no-prefix-caching": True,
    }
    for flag, (_, field, _) in flag_table({"keys": "", "token": "", "hosts": ""}).items():
        if flag == "--model":
            continue
        default = effective.get(flag, legacy_flags("controller")[flag]["default"])
        assert getattr(config, field) == default, flag
    # Fields that are not flags keep their values too.
    assert config.reconnect_backoff_min == 0.2 and config.executor_token == ""


def test_vllm_names_are_aliases():
    config = load(
        [
            "--model",
            MODEL,
            "--no-enable-prefix-caching",
            "--scheduling-policy",
            "priority",
            "--num-gpu-blocks-override",
            "64",
            "--shutdown-timeout",
            "3",
        ]
    )
    assert not config.enable_prefix_caching and config.policy == "priority"
    assert config.num_kv_blocks == 64 and config.shutdown_grace == 3.0
    assert load(["--model", MODEL, "--enable-prefix-caching"]).enable_prefix_caching
    assert not load(["--model", MODEL, "--no-prefix-caching"]).enable_prefix_caching


def sample(field) -> str:
    """A variable's text for a setting that differs from its default."""
    if field.annotation is bool:
        return "false" if field.default else "true"
    return {str: "x", int: "7", float: "0.75"}.get(field.annotation, "a,b")


def test_every_setting_has_its_variable(tmp_path):
    """TANDEM_<FIELD> sets every setting (aliases included: pydantic-settings alone would read
    SCHEDULING_POLICY for `policy`); the API key variable adds one key."""
    (tmp_path / "t").write_text("tok")
    special = {  # values a plain sample does not fit
        "model": str(tmp_path / "Dir"),
        "policy": "priority",
        "log_format": "json",
        "tool_call_parser": "hermes",
        "pipeline_depth": "3",
        "executor_limits": "tpu=64,8,gpu=512",
        "auth_token_file": str(tmp_path / "t"),
        "api_key_files": "",
        "admin_api_key_files": "",
        "auth_exempt_paths": "/a,/b",
        "peer_affinity_load_factor": "1.5",
    }
    for name, field in ControllerConfig.model_fields.items():
        if not fields.is_setting(field) or not fields.reads_env(field):
            continue
        value = special.get(name, sample(field))
        config = load([], {"TANDEM_MODEL": "/m/x", fields.env_name(name): value})
        default = ControllerConfig.model_fields[name].default
        if name not in ("api_key_files", "admin_api_key_files"):
            assert getattr(config, name) != default, name
    config = load([], {"TANDEM_MODEL": "/m/x", "TANDEM_EXECUTOR_LIMITS": "tpu=64,8,gpu=512"})
    assert config.kind_limits == {"tpu": (64, 8), "gpu": (512, 128)}
    assert load([], {"TANDEM_MODEL": "/m/x", "TANDEM_POLICY": "priority"}).policy == "priority"
    # Alias names are not variables (only TANDEM_<FIELD> is).
    assert load(["--model", "m"], {"SCHEDULING_POLICY": "priority"}).policy == "fcfs"
    assert load(["--model", "m"], {"TANDEM_SCHEDULING_POLICY": "priority"}).policy == "fcfs"


def test_api_keys_add_up_from_flags_files_and_the_variable(files, monkeypatch):
    monkeypatch.setenv("TANDEM_API_KEY", "env-key")
    config = load(["--model", MODEL, "--api-key", "a,b", "--api-key-file", files["keys"]])
    assert config.api_keys == ["a,b", "file-key", "env-key"]  # a comma stays in its key


def test_admin_keys_add_up_and_stay_apart_from_api_keys(files, monkeypatch, capsys):
    monkeypatch.setenv("TANDEM_ADMIN_API_KEY", "env-admin")
    config = load(
        ["--model", MODEL, "--admin-api-key", "a1", "--admin-api-key-file", files["keys"]]
    )
    assert config.admin_api_keys == ["a1", "file-key", "env-admin"]
    assert config.api_keys == []
    message = bad(capsys, ["--model", MODEL, "--api-key", "same", "--admin-api-key", "same"])
    assert "admin key may not also be an API key" in message


def test_http_server_bounds():
    config = load(["--model", MODEL])
    assert (config.http_max_connections, config.http_max_header_bytes) == (2048, 65536)
    assert (config.http_header_timeout, config.http_body_timeout) == (20.0, 60.0)
    config = load(["--model", MODEL, "--http-header-timeout", "0", "--http-max-connections", "9"])
    assert (config.http_header_timeout, config.http_max_connections) == (0.0, 9)


def test_peers_and_the_advertised_address():
    import socket

    config = load(["--model", MODEL])
    assert (config.peers, config.peer_dns, config.peer_files) == ([], [], [])  # no peers
    assert config.advertise_address == f"{socket.gethostname()}:8000"  # wildcard --host
    assert (config.peer_probe_interval, config.handover_drain_timeout) == (1.0, 30.0)
    config = load(
        ["--model", MODEL, "--host", "127.0.0.1", "--port", "9000", "--peer", "10.0.0.2:8000"],
        {"TANDEM_PEER_DNS": "controllers.ns.svc:8000"},
    )
    assert config.advertise_address == "127.0.0.1:9000"
    assert (config.peers, config.peer_dns) == (["10.0.0.2:8000"], ["controllers.ns.svc:8000"])
    config = load(["--model", MODEL, "--host", "::1", "--advertise-address", "ctl-0:8000"])
    assert config.advertise_address == "ctl-0:8000"
    assert load(["--model", MODEL, "--host", "::1"]).advertise_address == "[::1]:8000"


def test_precedence_flag_over_variable_over_file_over_default(tmp_path):
    config_file = tmp_path / "controller.yaml"
    config_file.write_text(
        "model: /m/from-file\nmax-num-seqs: 8\nmax_num_batched_tokens: 256\n"
        "port: 7000\nexecutor:\n  - a:1\n  - b:2\nprefix-caching: false\n"
    )
    argv = ["--config", str(config_file), "--max-num-seqs", "32"]
    env = {"TANDEM_MAX_NUM_SEQS": "16", "TANDEM_MAX_NUM_BATCHED_TOKENS": "1024"}
    config = load(argv, env)
    assert config.max_num_seqs == 32  # flag > variable > file
    assert config.max_num_batched_tokens == 1024  # variable > file
    assert config.port == 7000 and config.model == "/m/from-file"  # file > default
    assert config.executors == ["a:1", "b:2"]  # keys by any name, with - or _
    assert config.max_model_len == 0 and not config.enable_prefix_caching
    assert load(["--model", "m"], {}, defaults={"port": 1}).port == 1  # caller's default


def test_config_file_errors(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nmax-num-sequences: 4\n")
    assert "unknown setting 'max-num-sequences'" in bad(capsys, ["--config", str(path)])
    path.write_text("kind_limits: {}\n")  # a derived field is no setting
    assert "unknown setting 'kind_limits'" in bad(capsys, ["--config", str(path), "--model", "m"])
    path.write_text("- a\n")
    assert "expected a mapping" in bad(capsys, ["--config", str(path)])
    path.write_text("model: m\nmax_num_seqs: lots\n")
    assert f"{path}: max_num_seqs: Input should be a valid integer" in bad(
        capsys, ["--config", str(path)]
    )
    assert "cannot read" in bad(capsys, ["--config", str(tmp_path / "missing.yaml")])


def test_bad_values_exit_2_naming_the_flag(capsys):
    assert "argument --max-num-seqs: Input should be a valid integer" in bad(
        capsys, ["--model", "m", "--max-num-seqs", "many"]
    )
    assert "argument --pipeline-depth: Input should be less than or equal to 4" in bad(
        capsys, ["--model", "m", "--pipeline-depth", "5"]
    )
    assert "argument --policy/--scheduling-policy: Input should be 'fcfs' or 'priority'" in bad(
        capsys, ["--model", "m", "--policy", "lifo"]
    )
    assert "argument --executor-limits: 'tpu=x': expected KIND=TOKENS[,SEQS]" in bad(
        capsys, ["--model", "m", "--executor-limits", "tpu=x"]
    )
    assert "TANDEM_PORT: Input should be a valid integer" in bad(
        capsys, ["--model", "m"], {"TANDEM_PORT": "http"}
    )
    assert "--model is required (or TANDEM_MODEL" in bad(capsys, [])
    assert "unrecognized arguments: --max-num-seq" in bad(capsys, ["--max-num-seq", "4"])
    assert "auth_token_file" not in bad(capsys, ["--model", "m", "--auth-token-file", "/nope"])


def test_executor_limits_default_seqs_and_several_per_value():
    config = load(["--model", "m", "--max-num-seqs", "32", "--executor-limits", "tpu=64"])
    assert config.kind_limits == {"tpu": (64, 32)}
    config = load(["--model", "m", "--executor-limits", "tpu=64,8", "--executor-limits", "cpu=9"])
    assert config.kind_limits == {"tpu": (64, 8), "cpu": (9, 128)}


def test_help_lists_every_flag_with_default_and_variable(capsys):
    with pytest.raises(SystemExit) as exc:
        load(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert legacy_help_flags("controller") <= set(out.replace(",", " ").split())
    for name, field in ControllerConfig.model_fields.items():
        if fields.reads_env(field):
            assert fields.env_name(name) in out, name
    assert "(default: 128)" in out and "--config FILE" in out
    assert "fleet: discovery, health, failover, placement:" in out  # sections by topic


def test_direct_construction_reads_nothing_from_outside(monkeypatch):
    monkeypatch.setenv("TANDEM_MAX_NUM_SEQS", "3")
    config = ControllerConfig(model="unused", executor_dns=["n:1"])
    assert config.max_num_seqs == 128 and config.executors == []  # no derivation either


def test_python_m_controller_help():
    out = subprocess.run(
        [sys.executable, "-m", "controller", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert out.startswith("usage: python -m controller") and "--executor-limits" in out
    config = load_config(["--model", os.path.join("a", "b", "")], "x")
    assert config.served_model_name == "b"
