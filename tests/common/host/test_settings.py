"""The executors' settings: one definition shared by every executor kind (ExecutorSettings, its
worker's config ExecutorConfig), subclassed by the TPU executor and the simulator; every flag
of before still works with its default, vLLM's names are aliases, TANDEM_<FIELD> sets each
setting, and bad values exit 2 naming their flag."""

from __future__ import annotations

import subprocess
import sys

import pytest

from common.host.settings import ExecutorConfig, ExecutorSettings
from common.settings import fields
from executor_sim.latency import LatencyModel
from executor_sim.options import SimOptions, SimSettings
from executor_tpu.options import TPUOptions, TPUSettings
from tests.support.legacy import legacy_flags, legacy_help_flags
from tests.support.processes import ROOT

MODEL = "/models/Some-Model"

# Old flag -> (a value, the field it sets, what the field then holds): every executor's flags.
SHARED = {
    "--auth-token-file": ("/run/token", "auth_token_file", "/run/token"),
    "--block-size": ("32", "block_size", 32),
    "--device": ("cpu", "device", "cpu"),
    "--dtype": ("bfloat16", "dtype", "bfloat16"),
    "--enforce-eager": (None, "enforce_eager", True),
    "--gpu-memory-utilization": ("0.5", "gpu_memory_utilization", 0.5),
    "--health-port": ("50052", "health_port", 50052),
    "--host": ("127.0.0.1", "host", "127.0.0.1"),
    "--kv-cache-bytes": ("1048576", "kv_cache_bytes", 1 << 20),
    "--load-format": ("dummy", "load_format", "dummy"),
    "--log-level": ("DEBUG", "log_level", "DEBUG"),
    "--max-logprobs": ("4", "max_logprobs", 4),
    "--max-model-len": ("512", "max_model_len", 512),
    "--metrics-port": ("9100", "metrics_port", 9100),
    "--model": ("/m/Other", "model", "/m/Other"),
    "--no-chunked-prefill": (None, "chunked_prefill", False),
    "--num-threads": ("2", "num_threads", 2),
    "--port": ("50060", "port", 50060),
    "--seed": ("9", "seed", 9),
    "--served-model-name": ("chat", "served_model_name", "chat"),
    "--shutdown-drain": ("1.5", "shutdown_drain", 1.5),
    "--tls-cert": ("/tls/s.crt", "tls_cert", "/tls/s.crt"),
    "--tls-client-ca": ("/tls/ca.crt", "tls_client_ca", "/tls/ca.crt"),
    "--tls-key": ("/tls/s.key", "tls_key", "/tls/s.key"),
}
TPU = {
    "--attention": ("gather", "attention", "gather"),
    "--compile-cache-dir": ("/var/cache/xla", "compile_cache_dir", "/var/cache/xla"),
    "--kv-layout": ("plain", "kv_layout", "plain"),
    "--request-buckets": ("8,16", "request_buckets", [8, 16]),
    "--token-buckets": ("32,128", "token_buckets", [32, 128]),
}
SIM = {
    "--count": ("3", "count", 3),
    "--device-kind": ("tpu", "device_kind", "tpu"),
    "--device-name": ("v5e", "device_name", "v5e"),
    "--eos-prob": ("0.1", "eos_prob", 0.1),
    "--num-blocks": ("64", "num_blocks", 64),
    "--ports-file": ("/tmp/ports", "ports_file", "/tmp/ports"),
    "--sample-vocab-size": ("100", "sample_vocab_size", 100),
    "--step-fixed-ms": ("2", "step_fixed_ms", 2.0),
    "--step-jitter": ("0.1", "step_jitter", 0.1),
    "--step-per-context-token-ns": ("3", "step_per_context_token_ns", 3.0),
    "--step-per-request-us": ("4", "step_per_request_us", 4.0),
    "--step-per-token-us": ("5", "step_per_token_us", 5.0),
}
PROGRAMS = {  # program -> (its settings class, its flag table)
    "executor_gpu": (ExecutorSettings, SHARED),
    "executor_tpu": (TPUSettings, {**SHARED, **TPU}),
    "executor_sim": (SimSettings, {**SHARED, **SIM}),
}
TLS = ["--tls-cert", "/c", "--tls-key", "/k"]  # the TLS flags go together


def load(cls, argv: list[str], environ: dict | None = None):
    return cls.load(argv, prog="executor", environ=environ or {})


# Defaults changed on purpose since the legacy flags, each with its reason.
CHANGED_DEFAULTS = {
    # issue 19: the checkpoint's dtype on accelerators, float32 on the CPU as before
    "--dtype": "auto",
}


def bad(capsys, cls, argv: list[str], environ: dict | None = None) -> str:
    """The message of a refused command line (exit status 2)."""
    with pytest.raises(SystemExit) as exc:
        load(cls, argv, environ)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_old_flag_is_accepted_with_its_default(program):
    cls, table = PROGRAMS[program]
    old = legacy_flags(program)
    assert set(table) == set(old)  # the table covers every old flag
    defaults = load(cls, ["--model", MODEL])
    for flag, (value, field, expected) in table.items():
        extra = TLS if flag in ("--tls-cert", "--tls-key", "--tls-client-ca") else []
        argv = ["--model", MODEL, *extra, flag] + ([] if value is None else [value])
        assert getattr(load(cls, argv), field) == expected, flag
        if flag != "--model":
            default = old[flag]["default"]
            default = not default if flag.startswith("--no-") else default
            default = CHANGED_DEFAULTS.get(flag, default)
            assert getattr(defaults, field) == default, flag


def test_vllm_names_are_aliases():
    s = load(
        ExecutorSettings,
        ["--model", MODEL, "--no-enable-chunked-prefill", "--kv-cache-memory-bytes", "4096"],
    )
    assert not s.chunked_prefill and s.kv_cache_bytes == 4096
    assert load(ExecutorSettings, ["--model", MODEL, "--enable-chunked-prefill"]).chunked_prefill


def test_the_settings_are_the_workers_config(monkeypatch):
    settings = load(TPUSettings, ["--model", MODEL, "--seed", "4", "--token-buckets", "16"])
    assert isinstance(settings, ExecutorConfig) and isinstance(settings, TPUOptions)
    copy = settings.model_copy(update={"seed": 5})  # what --count does per simulated executor
    assert copy.seed == 5 and settings.seed == 4 and copy.token_buckets == [16]
    # Tests and benchmarks build configs directly: defaults and arguments, no environment.
    monkeypatch.setenv("TANDEM_SEED", "7")
    config = ExecutorConfig(model="m", dtype="bfloat16", max_num_seqs=8)
    assert config.seed == 0 and config.max_num_seqs == 8 and config.max_num_batched_tokens == 2048
    config.max_num_seqs = 16  # the worker takes InitDevice's limits
    assert config.max_num_seqs == 16


def sample(field) -> str:
    """A variable's text for a setting that differs from its default."""
    if field.annotation is bool:
        return "false" if field.default else "true"
    return {str: "x", int: "7", float: "0.75"}.get(field.annotation, "8,16")


@pytest.mark.parametrize("cls", [TPUSettings, SimSettings])
def test_every_setting_has_its_variable(cls):
    special = {"dtype": "float16", "load_format": "dummy", "log_format": "json", "device": "cpu"}
    special |= {"kv_cache_dtype": "bfloat16", "overlap_steps": "off"}
    special |= {"attention": "gather", "kv_layout": "plain", "count": "2", "fault": "hang"}
    for name, field in cls.model_fields.items():
        if not fields.reads_env(field):
            assert not fields.is_setting(field), name  # every setting has one
            continue
        value = special.get(name, sample(field))
        environ = {"TANDEM_MODEL": "/m", fields.env_name(name): value}
        if name in ("tls_cert", "tls_key", "tls_client_ca"):
            environ |= {"TANDEM_TLS_CERT": "/c", "TANDEM_TLS_KEY": "/k"}
        settings = load(cls, [], environ)
        assert getattr(settings, name) != field.default, name
    assert load(TPUSettings, [], {"TANDEM_MODEL": "m", "TANDEM_TOKEN_BUCKETS": "[16, 64]"}) == (
        load(TPUSettings, ["--model", "m", "--token-buckets", "16,64"])
    )


def test_bad_values_exit_2_naming_the_flag(capsys):
    assert "argument --dtype: Input should be 'auto', 'float32', 'bfloat16' or 'float16'" in bad(
        capsys, ExecutorSettings, ["--model", "m", "--dtype", "fp8"]
    )
    assert "argument --tls-cert: --tls-cert and --tls-key go together" in bad(
        capsys, ExecutorSettings, ["--model", "m", "--tls-cert", "/c"]
    )
    assert "--tls-client-ca needs --tls-cert and --tls-key" in bad(
        capsys, ExecutorSettings, ["--model", "m", "--tls-client-ca", "/ca"]
    )
    assert "argument --token-buckets: Input should be greater than 0" in bad(
        capsys, TPUSettings, ["--model", "m", "--token-buckets", "16,0"]
    )
    assert "argument --request-buckets: Input should be a valid integer" in bad(
        capsys, TPUSettings, ["--model", "m", "--request-buckets", "8,x"]
    )
    assert "argument --device: the TPU executor takes auto, tpu or cpu" in bad(
        capsys, TPUSettings, ["--model", "m", "--device", "cuda"]
    )
    assert "argument --attention: Input should be 'auto', 'ragged' or 'gather'" in bad(
        capsys, TPUSettings, ["--model", "m", "--attention", "flash"]
    )
    assert "--health-port serves one executor: not with --count" in bad(
        capsys, SimSettings, ["--model", "m", "--count", "2", "--health-port", "9"]
    )
    assert "TANDEM_TOKEN_BUCKETS: cannot decode '[1,'" in bad(
        capsys, TPUSettings, ["--model", "m"], {"TANDEM_TOKEN_BUCKETS": "[1,"}
    )


def test_config_file_and_precedence(tmp_path, capsys):
    path = tmp_path / "tpu.yaml"
    path.write_text("model: /m\ntoken-buckets: 16,32\nrequest_buckets: [4]\nseed: 1\nport: 5\n")
    s = load(TPUSettings, ["--config", str(path), "--seed", "3"], {"TANDEM_SEED": "2"})
    assert s.token_buckets == [16, 32] and s.request_buckets == [4] and s.seed == 3
    assert load(TPUSettings, ["--config", str(path)], {"TANDEM_SEED": "2"}).seed == 2
    path.write_text("model: /m\nexecutor-limits: tpu=1\n")  # the controller's, not ours
    assert "unknown setting 'executor-limits'" in bad(capsys, TPUSettings, ["--config", str(path)])


def test_sim_options_give_the_latency_model():
    options = SimOptions(step_fixed_ms=2.0, step_per_token_us=10.0, step_jitter=0.1)
    assert options.latency == LatencyModel(0.002, 10e-6, 0.0, 0.0, 0.1)
    assert SimOptions().latency == LatencyModel()  # the flags' defaults are the model's
    given = LatencyModel(fixed_s=0.0, per_token_s=0.0)  # code may give the model itself
    assert SimOptions(latency=given, num_blocks=3).latency is given
    many = load(SimSettings, ["--model", "m", "--ports-file", "/p"])
    assert many.serves_many and not load(SimSettings, ["--model", "m"]).serves_many


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_help_lists_every_flag_with_default_and_variable(program):
    cls = PROGRAMS[program][0]
    out = subprocess.run(
        [sys.executable, "-m", program, "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        check=True,
    ).stdout
    assert out.startswith(f"usage: python -m {program}")
    assert legacy_help_flags(program) <= set(out.replace(",", " ").split())
    for name, field in cls.model_fields.items():
        if fields.reads_env(field):
            assert fields.env_name(name) in out, name
    assert "(default: 50051)" in out and "--log-format {text,json}" in out
