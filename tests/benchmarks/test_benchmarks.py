"""The benchmarks run: serve.py against a controller with a simulated executor, controlplane.py
on a tiny grid, and the helpers compare.py builds its report from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.compare import format_table
from benchmarks.serve import Workload, make_requests, parse_range, percentiles
from tests.support.processes import ROOT, spawn_controller, spawn_executor, wait_healthy_executors

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")


def run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_workload_helpers():
    assert parse_range("7") == (7, 7) and parse_range("3:9") == (3, 9)
    specs = make_requests(
        Workload(
            num_prompts=6,
            input_len=(4, 8),
            output_len=(2, 5),
            shared_prefix_len=10,
            num_prefix_groups=2,
        )
    )
    assert len(specs) == 6 and all(2 <= s.output_len <= 5 for s in specs)
    prefixes = {" ".join(s.prompt.split()[:10]) for s in specs}
    assert len(prefixes) == 2
    stats = percentiles([1.0, 2.0, 3.0, 4.0], scale=1.0)
    assert stats["mean"] == 2.5 and stats["p50"] == 2.5 and stats["p99"] == pytest.approx(3.97)
    table = format_table(
        {
            "tandem": {"request_throughput": 2.0, "output_throughput": 100.0},
            "hf_static": {"request_throughput": 1.0, "output_throughput": 50.0},
        }
    )
    assert table.splitlines()[-1].split()[-1] == "2.00"


@pytest.fixture(scope="module")
def sim_server(default_model_dir, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("bench"))
    proc, port = spawn_executor(
        "executor_sim",
        default_model_dir,
        tmp,
        "sim",
        extra=["--num-blocks", "512", "--step-fixed-ms", "2"],
    )
    server = spawn_controller(default_model_dir, tmp, ["--executor", f"127.0.0.1:{port}"])
    server.executors.append(proc)
    try:
        wait_healthy_executors(server, 1, timeout=120)
        yield server
    finally:
        server.stop()


def test_serve_benchmark_reports(sim_server, tmp_path):
    out = tmp_path / "serve.json"
    proc = run_script(
        [
            "benchmarks/serve.py",
            "--base-url",
            sim_server.base_url,
            "--num-prompts",
            "6",
            "--concurrency",
            "3",
            "--request-rate",
            "50",
            "--input-len",
            "8:16",
            "--output-len",
            "8",
            "--shared-prefix-len",
            "4",
            "--result-json",
            str(out),
        ],
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(out.read_text())
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == 48 and summary["total_input_tokens"] > 0
    for key in ("request_throughput", "output_throughput", "total_token_throughput"):
        assert summary[key] > 0
    for key in LATENCY_KEYS:
        assert set(summary[key]) == {"mean", "p50", "p90", "p99"}
    assert 0 < summary["ttft_ms"]["p50"] <= summary["e2e_ms"]["p50"]
    assert "output throughput" in proc.stdout


def test_controlplane_tiny_grid(default_model_dir, tmp_path):
    out = tmp_path / "cp.json"
    proc = run_script(
        [
            "benchmarks/controlplane.py",
            "--model",
            default_model_dir,
            "--running",
            "16",
            "--executors",
            "1",
            "--window",
            "1.5",
            "--settle",
            "0.3",
            "--output-len",
            "512",
            "--transports",
            "grpc,socket",
            "--json",
            str(out),
            "--log-dir",
            str(tmp_path / "logs"),
        ],
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr + "".join(
        open(os.path.join(tmp_path / "logs", f)).read()[-2000:]
        for f in os.listdir(tmp_path / "logs")
    )
    points = json.loads(out.read_text())["points"]
    assert [p["transport"] for p in points] == ["grpc", "socket"]  # each checked by the script
    for point in points:
        assert point["executors"] == 1 and point["running"] == 16
        # a step is counted when it ends: one straddling the window's start counts whole
        assert 0 < point["busy_fraction"] <= 1.02
        assert point["cpu_ms_per_step"] > 0 and point["cpu_us_per_token"] > 0
        assert point["bytes_per_request_decode"] > 0 and point["steps_per_s"] > 0


def test_compare_runs_tandem_over_either_transport(default_model_dir, tmp_path):
    """compare.py's Tandem, steps over the step socket and over gRPC, in one run: the same
    greedy workload completes on both, and the ratio is reported."""
    out = tmp_path / "compare.json"
    run = run_script(
        ["benchmarks/compare.py", "--model", default_model_dir, "--systems", "tandem,tandem_grpc"]
        + ["--concurrency", "2", "--num-prompts", "2", "--input-len", "8", "--output-len", "4"]
        + ["--kv-cache-mib", "64", "--json", str(out)],
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["failed"] == {}
    for name in ("tandem", "tandem_grpc"):
        assert report["results"][name]["completed"] == 2, report["results"][name]
    assert report["ratios"]["tandem"] == 1.0 and report["ratios"]["tandem_grpc"] > 0


def test_controller_step_benchmark(default_model_dir, tmp_path):
    out = tmp_path / "cs.json"
    run = run_script(
        [
            "benchmarks/controller_step.py",
            "--model",
            default_model_dir,
            "--running",
            "4,12",
            "--steps",
            "30",
            "--output-len",
            "16",
            "--json",
            str(out),
        ],
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    points = json.loads(out.read_text())["points"]
    assert [p["running"] for p in points] == [4, 12]
    for p in points:
        assert p["steps"] >= 30 and 0 < p["batch"] <= p["running"]
        assert p["cpu_ms_per_step"] > 0 and p["cpu_us_per_request_step"] > 0


def test_controller_step_benchmark_with_writer_sinks(default_model_dir, tmp_path):
    """--tokens: requests streamed through writer sinks (token ids into a frame per step);
    requests end and are replaced, so every step keeps its batch."""
    out = tmp_path / "cs_tokens.json"
    run = run_script(
        [
            "benchmarks/controller_step.py",
            "--model",
            default_model_dir,
            "--running",
            "6",
            "--steps",
            "40",
            "--output-len",
            "8",
            "--tokens",
            "--json",
            str(out),
        ],
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    (point,) = json.loads(out.read_text())["points"]
    assert point["steps"] >= 40 and 0 < point["batch"] <= 6
    assert point["cpu_us_per_request_step"] > 0


def test_cpu_step_benchmark_times_every_variant(default_model_dir, tmp_path):
    out = tmp_path / "cpu_step.json"
    run = run_script(
        [
            "benchmarks/cpu_step.py",
            "--model",
            default_model_dir,
            "--batch-sizes",
            "1,3",
            "--context",
            "20",
            "--steps",
            "2",
            "--json",
            str(out),
        ],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["batch"], r["variant"]) for r in rows} == {
        (b, v) for b in (1, 3) for v in ("torch", "fused", "packed")
    }
    for r in rows:
        assert r["decode_step_ms"] > 0 and r["prefill_s"] > 0 and r["speedup"] > 0
        assert r["decode_tok_s"] == pytest.approx(r["batch"] * 1e3 / r["decode_step_ms"])


def test_cpu_step_benchmark_compares_dtypes(default_model_dir, tmp_path):
    """--dtype float32,bfloat16: each variant in each dtype, in one run (bf16's ratio)."""
    out = tmp_path / "cpu_step.json"
    run = run_script(
        ["benchmarks/cpu_step.py", "--model", default_model_dir, "--batch-sizes", "1"]
        + ["--context", "20", "--steps", "2", "--variants", "packed"]
        + ["--dtype", "float32,bfloat16", "--json", str(out)],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert [(r["variant"], r["dtype"]) for r in rows] == [
        ("packed-f32", "float32"),
        ("packed-bf16", "bfloat16"),
    ]
    assert rows[0]["speedup"] == 1.0 and rows[1]["speedup"] > 0


def test_gpu_step_benchmark_smoke_on_the_cpu(tmp_path):
    """The GPU script's own code on the CPU (tiny model, no graphs): its token-identity check
    against transformers passes and every timing section reports."""
    out = tmp_path / "gpu_step.json"
    run = run_script(
        [
            "benchmarks/gpu_step.py",
            "--smoke",
            "--batch-sizes",
            "1,3",
            "--context",
            "20",
            "--long-context",
            "40",
            "--tune",
            "--profile-host",
            "--json",
            str(out),
        ],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tiny_vs_hf"]["token_identical"] == report["tiny_vs_hf"]["requests"] == 4
    assert report["tiny_vs_hf"]["overlapped_identical"] == 4  # steps launched ahead: same tokens
    variants = {(r["batch"], r["context"], r["variant"]) for r in report["forward"]}
    assert {(1, 20, "graph"), (3, 20, "fused"), (3, 40, "graph")} <= variants
    assert all(r["ms"] > 0 and r["kv_bytes"] > 0 for r in report["forward"])
    assert report["executor_step_ms"] > 0
    steps = report["executor_steps"]  # one at a time and overlapped, three rounds each
    assert len(steps["rounds"]["overlapped_ms"]) == 3 and steps["overlapped_ms"] > 0
    # --profile-host: the host profile, and the overlapped steps' (no device time on the CPU)
    assert report["host_profile"] and report["overlap_profile"]["wall_ms"] > 0
    # Prefill: the runner's path ("old") and the Triton kernel under the interpreter ("new"),
    # attention alone and the forward pass, every case.
    assert report["prefill_backends"]["new"] == "triton_paged"
    for key in ("prefill_attention", "prefill_forward"):
        assert len(report[key]) == 3, report[key]
        assert all(r["old"]["ms"] > 0 and r["new"]["ms"] > 0 for r in report[key])
    # --tune: every launch setting of the prefill kernel ran (the interpreter ignores warps and
    # stages, not the tiles or the program order).
    from benchmarks.gpu_tuning import PREFILL_VARIANTS

    assert len(report["tune_prefill"]) == 3 * len(PREFILL_VARIANTS)
    for r in report["tune_prefill"]:
        assert r["us"] > 0 and not r["error"], r


def test_gpu_attention_ab_compares_two_versions_of_the_kernels(tmp_path):
    """gpu_attention_ab.py under the interpreter, the "earlier" version being a copy of the
    current files: every case timed for both, with the same outputs."""
    import shutil

    base = tmp_path / "base"
    base.mkdir()
    for name in ("triton_prefill", "triton_attention"):
        shutil.copy(os.path.join(ROOT, "executor_gpu", "cuda", f"{name}.py"), base)
    out = tmp_path / "ab.json"
    args = ["benchmarks/gpu_attention_ab.py", "--smoke", "--rounds", "1"]
    run = run_script(args + ["--base-dir", str(base), "--json", str(out)], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["kernel"] for r in rows] == ["prefill"] * 3 + ["decode"]
    for r in rows:
        assert r["base_us"] > 0 and r["new_us"] > 0 and r["base_over_new"] > 0
        assert r["output_diff"] == 0.0, r


def test_gpu_linear_times_cublas_and_the_triton_candidate(tmp_path):
    """gpu_linear.py under the interpreter: every launch setting on both weight layouts beside
    torch's product, each with its error against float64 (the candidate's indexing checked on
    shapes with partial row tiles); one layer's products both ways; the logits both ways, the
    same values."""
    from benchmarks.gpu_linear import SMOKE_SHAPES, SMOKE_TILES

    out = tmp_path / "linear.json"
    run = run_script(
        ["benchmarks/gpu_linear.py", "--smoke", "--rows", "5", "--json", str(out)], timeout=300
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    rows = report["sweep"]
    assert len(rows) == len(SMOKE_SHAPES) * 2 * (1 + len(SMOKE_TILES))
    for r in rows:
        assert "error" not in r and r["us"] > 0, r
        assert r["rel_err"] < 1e-5, r  # float32 on the CPU
    assert {r["kind"] for r in rows} == {"cublas", "triton"}
    [layer] = report["layer"]
    assert layer["cublas_ms"] > 0 and layer["triton_ms"] > 0
    [logits] = report["logits"]
    assert logits["torch_us"] > 0 and logits["cuda_us"] > 0 and logits["max_abs_diff"] < 1e-5


def test_gpu_decode_attention_sweeps_settings_at_mixed_lengths(tmp_path):
    """gpu_decode_attention.py under the interpreter: every setting on every shape (equal and
    mixed lengths), each within float32 error of the reference, and the summary's best."""
    from benchmarks.gpu_decode_attention import (
        SMOKE_PARTS,
        SMOKE_SHAPES,
        SMOKE_TILES,
        SMOKE_WARPS,
        lengths_for,
    )

    assert lengths_for(8, 20, 70) == lengths_for(8, 20, 70)  # seeded
    assert len(set(lengths_for(8, 20, 70))) > 1 and set(lengths_for(3, 40, 40)) == {40}
    out = tmp_path / "attention.json"
    run = run_script(["benchmarks/gpu_decode_attention.py", "--smoke", "--json", str(out)], 300)
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    settings = len(SMOKE_TILES) * len(SMOKE_WARPS) * len(SMOKE_PARTS)
    assert len(report["rows"]) == len(SMOKE_SHAPES) * settings
    for r in report["rows"]:
        assert "error" not in r and r["us"] > 0 and r["rel_err"] < 1e-5, r
    assert set(report["summary"]) == {name for name, *_ in SMOKE_SHAPES}


def test_tp_step_benchmark_measures_both_sizes_and_models_the_traffic(tmp_path):
    """TP=1 and TP=2 timed in one run (CPU, gloo) with their ratio; the traffic model's rows."""
    from benchmarks.tp_step import SHAPES, traffic_bytes

    out = tmp_path / "tp_step.json"
    run = run_script(
        ["benchmarks/tp_step.py", "--batch-sizes", "1,4", "--context", "32", "--json", str(out)],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert [r["batch"] for r in report["measured"]] == [1, 4]
    assert all(r["tp1_ms"] > 0 and r["tp2_ms"] > 0 and r["ratio"] > 0 for r in report["measured"])
    assert len(report["modelled"]) == 2 * 2 * 3
    # Llama-3-8B, one decode token over 2 ranks: 65 all-reduces of 4096 bf16 values, each
    # rank sending half of the tensor twice (ring), plus half the vocabulary's float32 logits.
    assert traffic_bytes(SHAPES["llama3-8b"], 1, 1, 2, 2) == 65 * 4096 * 2 + 64128 * 4
    assert traffic_bytes(SHAPES["llama3-8b"], 1, 1, 1, 2) == 0


def test_grammar_engines_runs_and_grows_a_valid_vocabulary(default_model_dir, tmp_path):
    """grammar_engines.py on the chosen engine at 49k, and its 150k vocabulary a valid BPE
    tokenizer (the extra engines are not project dependencies)."""
    from tokenizers import Tokenizer

    from benchmarks.grammar_engines import extend_vocab, token_bytes

    base = json.loads((Path(default_model_dir) / "tokenizer.json").read_text())
    grown = extend_vocab(base, 50_000)
    tok = Tokenizer.from_str(json.dumps(grown))
    assert tok.get_vocab_size() == 50_000 and len(token_bytes(grown)) == 50_000
    text = "The quick brown fox"
    assert tok.decode(tok.encode(text).ids) == text
    out = tmp_path / "g.json"
    args = ["benchmarks/grammar_engines.py", "--engines", "llguidance", "--vocabs", "49k"]
    args += ["--model-dir", default_model_dir, "--workdir", str(tmp_path), "--json", str(out)]
    done = run_script(args, timeout=300)
    assert done.returncode == 0, done.stderr
    (result,) = json.loads(out.read_text()).values()
    llg = result["llguidance"]
    assert llg["torch_imported"] is False
    assert llg["json"]["accepting"] and llg["regex"]["accepting"]


def test_gpu_step_benchmark_smoke_sharded_over_two_ranks(tmp_path):
    """The GPU script with --tensor-parallel-size 2 on the CPU: rank 0 plus a follower, the
    fused (eager) variant timed, the whole executor step run."""
    out = tmp_path / "gpu_step_tp2.json"
    run = run_script(
        [
            "benchmarks/gpu_step.py",
            "--smoke",
            "--tensor-parallel-size",
            "2",
            "--batch-sizes",
            "1,3",
            "--context",
            "20",
            "--long-context",
            "0",
            "--json",
            str(out),
        ],
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tensor_parallel_size"] == 2 and report["graphs_captured"] == 0
    assert {(r["batch"], r["variant"]) for r in report["forward"]} == {(1, "fused"), (3, "fused")}
    assert report["executor_step_ms"] > 0


def test_structured_benchmark_runs_every_mix_over_the_simulator(default_model_dir, tmp_path):
    """structured.py: the three mixes in one run (ratios to the unconstrained one), the mask
    times per string schema, and the wire bytes of a masked step at both vocabularies."""
    out = tmp_path / "structured.json"
    args = ["benchmarks/structured.py", "--executor", "sim", "--requests", "4"]
    args += ["--concurrency", "2", "--items", "3", "--json", str(out)]
    done = run_script(args, timeout=300)
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    mixes = report["mixes"]
    assert [m["constrained"] for m in mixes] == [0.0, 0.5, 1.0, 0.0]
    assert mixes[3]["pipeline_depth"] == 1
    assert mixes[0]["throughput_ratio"] == 1.0 and all(m["output_tokens"] > 0 for m in mixes)
    assert set(report["mask_us"]) >= {"unbounded", "maxLength 6"}
    wire = report["wire_bytes_per_request_vocab151936"]
    assert wire["masked"] - wire["plain"] >= 151_936 // 8


def test_mask_apply_benchmark_times_masked_and_unmasked_sampling(tmp_path):
    """mask_apply.py on a tiny grid: every point timed both ways, with its wire bytes."""
    out = tmp_path / "mask.json"
    run = run_script(
        ["benchmarks/mask_apply.py", "--vocabs", "1000,4099", "--batch-sizes", "1,3"]
        + ["--reps", "2", "--threads", "1", "--json", str(out)],
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    rows = json.loads(out.read_text())["results"]
    assert {(r["vocab"], r["batch"], r["mode"]) for r in rows} == {
        (v, b, m) for v in (1000, 4099) for b in (1, 3) for m in ("greedy", "random")
    }
    for r in rows:
        assert r["unmasked_ms"] > 0 and r["masked_ms"] > 0 and r["mask_ms"] > 0
        assert r["ratio"] == pytest.approx(r["masked_ms"] / r["unmasked_ms"])
        assert r["mask_bytes_per_request"] == -(-r["vocab"] // 32) * 4
