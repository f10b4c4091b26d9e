"""The CUDA executor's decode step against the HBM-bandwidth bound, with its correctness checks.

One script for a lent GPU, in the order that matters:

1. ceilings: device-to-device copy bandwidth (bytes read + written), measured here;
2. correctness on CUDA: the Triton decode attention and fused layer ops against the torch
   reference (relative error), and a tiny random Llama served by ``GPUModelRunner`` with CUDA
   graphs, greedy, against transformers ``generate`` on the same GPU (token identity);
3. a Llama-3-8B-shaped model with random bf16 weights (``--load-format dummy``): the decode
   forward pass + logits at batch 1/16/64 with torch operators (eager), the fused kernels
   (eager) and the fused kernels replayed from CUDA graphs, timed with CUDA events; and the
   whole executor step (``execute_model``: inputs, replay, sampling, results) at batch 64, one
   step at a time and overlapped (benchmarks/gpu_executor_step.py);
4. (the linear layers alone, cuBLAS against a Triton candidate: benchmarks/gpu_linear.py);
5. prefill (benchmarks/gpu_prefill.py): the batched Triton prefill kernel against the torch
   prefills it replaced, attention alone and the whole forward pass, at steps of ~2048 new
   tokens, as TFLOPS and a fraction of the device's bf16 peak;
6. with ``--tune``, the prefill kernel's launch settings side by side
   (benchmarks/gpu_tuning.py).

The bound is the weights' bytes over 4.8 TB/s (the H200's datasheet bandwidth); the KV cache a
step reads is reported beside it, and ``over_copy`` is each decode time over the bytes it reads
(streamed weights + KV) at the measured copy rate. ``--smoke`` runs the same code on the CPU
with a tiny model (no graphs, no ceilings) so that the script is tested where there is no GPU.

    python benchmarks/gpu_step.py --json /tmp/gpu_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_executor_step import (  # noqa: E402
    compare_executor_steps,
    decode_step,
    overlapped_decodes,
    profile_executor_step,
    profile_overlapped_steps,
    start_requests,
)
from benchmarks.gpu_forward import (  # noqa: E402
    out_in_ops,
    profile_replay,
    recaptured_rows,
    time_forward,
)
from benchmarks.gpu_kernels import BLOCK, check_kernels, copy_bandwidth, sweep_attention  # noqa: E402
from benchmarks.gpu_prefill import (  # noqa: E402
    CASES,
    SMOKE_CASES,
    check_prefill_kernel,
    prefill_backends,
    summary,
    time_attention,
    time_prefill_forward,
)
from benchmarks.gpu_report import print_report  # noqa: E402
from benchmarks.gpu_tuning import tune_prefill  # noqa: E402
from common.host.settings import ExecutorConfig  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from executor_gpu.follower import start_sharded_runner  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402

HBM_BYTES_PER_S = 4.8e12  # H200 datasheet
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
    "eos_token_id": 128001,
}
TINY = {
    **LLAMA3_8B,
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "max_position_embeddings": 512,
    "eos_token_id": 0,
}


def check_tiny_vs_hf(device: torch.device, smoke: bool) -> dict:
    """Greedy tokens of a tiny random Llama through the runner (graphs on CUDA) against
    transformers on the same device, float32."""
    import transformers

    cfg = transformers.LlamaConfig(
        **{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")}
    )
    hf = transformers.AutoModelForCausalLM.from_config(cfg).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (7, 30, 61, 100)]
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        runner = GPUModelRunner(
            ExecutorConfig(model=path, device=str(device), max_num_seqs=8),
            load_model_geometry(path),
        )
        runner.load_model()
        runner.initialize_kv_cache(64)
        graphs = runner.capture_model() if not smoke else runner.enable_decode_graphs(False)
    outputs = [[t] for t in start_requests(runner, prompts)]
    for step in range(1, 24):
        tokens = decode_step(runner, [len(p) + len(o) for p, o in zip(prompts, outputs)], step)
        for o, t in zip(outputs, tokens):
            o.append(t)
    overlapped = overlapped_decodes(runner, prompts, 23)
    same = 0
    for p, o in zip(prompts, outputs):
        with torch.inference_mode():
            ref = hf.generate(
                torch.tensor([p], device=device),
                max_new_tokens=len(o),
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        same += o == ref[0, len(p) :].tolist()
    return {
        "graphs_captured": graphs,
        "requests": len(prompts),
        "token_identical": same,
        "overlapped_identical": sum(a == b for a, b in zip(overlapped, outputs)),
        "tokens_each": len(outputs[0]),
    }


def section(report: dict, key: str, fn) -> None:
    """report[key] = fn(), or the error it raised (one failing check does not end the run)."""
    started = time.perf_counter()
    try:
        report[key] = fn()
    except Exception as exc:  # reported, not fatal: the device time is precious
        traceback.print_exc()
        report[key] = {"error": repr(exc)}
    print(f"[{time.perf_counter() - started:6.1f}s] {key}: {report[key]}", flush=True)


def prefill_rows(report: dict, runner: GPUModelRunner, smoke: bool, sharded: bool) -> None:
    """The prefill sections: attention alone and the forward pass, old path and new."""
    backends = prefill_backends(runner)
    report["prefill_backends"] = backends
    cases = SMOKE_CASES if smoke else CASES
    section(report, "prefill_attention", lambda: time_attention(runner.device, backends, cases))
    if not sharded:  # (the ranks run the backend they loaded with)
        section(report, "prefill_forward", lambda: time_prefill_forward(runner, backends, cases))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=256, help="cached tokens per request")
    p.add_argument("--long-context", type=int, default=1024, help="also at batch max; 0 = off")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny model, no graphs")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="also: attention over every partition count and tile; graphs with "
        "cuBLASLt and with [out, in] weights",
    )
    p.add_argument(
        "--profile-host",
        action="store_true",
        help="also: cProfile of execute_model steps and CUPTI of overlapped steps (the "
        "device's busy time, kernels outside the graph) at the largest batch",
    )
    p.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="shard the Llama-3-8B-shaped model over N devices (follower ranks; no graphs)",
    )
    p.add_argument(
        "--tune",
        action="store_true",
        help="also: the prefill kernel's launch settings side by side (benchmarks/gpu_tuning.py)",
    )
    p.add_argument("--json", default="", help="write the report here; - prints it last")
    a = p.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda", None if smoke else 0)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    report: dict = {
        "device": "cpu" if smoke else torch.cuda.get_device_name(device),
        "torch": torch.__version__,
    }
    if not smoke:
        section(report, "copy_TBps", lambda: copy_bandwidth(device) / 1e12)
        section(report, "kernel_rel_err", lambda: check_kernels(device))
        section(report, "prefill_rel_err", lambda: check_prefill_kernel(device))
        section(report, "attention_sweep", lambda: sweep_attention(device, a.sweep))
    section(report, "tiny_vs_hf", lambda: check_tiny_vs_hf(device, smoke))

    shape = TINY if smoke else LLAMA3_8B
    contexts = [a.context] + ([a.long_context] if a.long_context else [])
    per = -(-(max(contexts) + 64) // BLOCK)
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(shape, f)
        cfg = ExecutorConfig(
            model=path,
            dtype="float32" if smoke else "bfloat16",
            device=str(device),
            max_num_seqs=max(batches),
            max_model_len=2048,
            load_format="dummy",
            tensor_parallel_size=a.tensor_parallel_size,
        )
        geometry = load_model_geometry(path, cfg.max_model_len)
        runner = (
            start_sharded_runner(cfg, geometry, device)
            if a.tensor_parallel_size > 1
            else GPUModelRunner(cfg, geometry)
        )
        runner.load_model()
    runner.initialize_kv_cache(1 + max(batches) * per)
    report["weights_bytes"] = runner.weights_bytes
    # Bytes a decode step streams: every weight but the input embedding (a few rows read).
    embed = runner.model.model.embed_tokens.weight
    report["streamed_weight_bytes"] = runner.weights_bytes - embed.numel() * embed.element_size()
    report["tensor_parallel_size"] = a.tensor_parallel_size
    sharded = a.tensor_parallel_size > 1
    section(
        report,
        "graphs_captured",
        lambda: (
            runner.capture_model() if not smoke or sharded else runner.enable_decode_graphs(False)
        ),
    )
    rows: list[dict] = []
    section(
        report,
        "forward_short",
        lambda: rows.extend(time_forward(runner, batches, a.context)) or len(rows),
    )
    if a.long_context:
        section(
            report,
            "forward_long",
            lambda: rows.extend(time_forward(runner, [max(batches)], a.long_context)) or len(rows),
        )
    if not smoke and not sharded:
        section(report, "profile", lambda: profile_replay(runner, max(batches), a.context))
    if not smoke and a.sweep and not sharded:  # the same graphs over cuBLASLt's GEMM heuristics
        section(
            report,
            "forward_cublaslt",
            lambda: (
                rows.extend(
                    recaptured_rows(runner, batches, a.context, "graph_lt", blas="cublaslt")
                )
                or len(rows)
            ),
        )
        section(report, "recaptured", runner.enable_decode_graphs)
    section(
        report,
        "executor_steps",
        lambda: compare_executor_steps(runner, max(batches), a.context),
    )
    steps = report["executor_steps"]
    report["executor_step_ms"] = steps.get("one_at_a_time_ms", steps)
    if a.profile_host:
        section(
            report, "host_profile", lambda: profile_executor_step(runner, max(batches), a.context)
        )
        section(
            report,
            "overlap_profile",
            lambda: profile_overlapped_steps(runner, max(batches), a.context),
        )
    if not smoke and a.sweep and not sharded:  # last: this one re-lays the weights out
        section(
            report,
            "forward_out_in",
            lambda: (
                rows.extend(
                    recaptured_rows(
                        runner, batches, a.context, "graph_oi", ops=out_in_ops(runner.fused_ops)
                    )
                )
                or len(rows)
            ),
        )
    bound_ms = report["bound_ms"] = runner.weights_bytes / HBM_BYTES_PER_S * 1e3
    g = runner.geometry
    for r in rows:
        kv = 2 * r["batch"] * r["context"] * g.num_kv_heads * g.head_dim * 2 * g.num_layers
        r.update(kv_bytes=kv, bound_ms=bound_ms, over_bound=r["ms"] / bound_ms)
    report["forward"] = rows
    copy_rate = report.get("copy_TBps")
    for r in rows:  # the decode step against the bytes it reads, at the measured copy rate
        read = report["streamed_weight_bytes"] + r["kv_bytes"]
        ok = isinstance(copy_rate, float)
        r["over_copy"] = r["ms"] / (read / (copy_rate * 1e12) * 1e3) if ok else None
    prefill_rows(report, runner, smoke, sharded)
    if a.tune:
        section(
            report, "tune_prefill", lambda: tune_prefill(device, SMOKE_CASES if smoke else CASES)
        )
    report["summary"] = summary(report)
    if a.json and a.json != "-":
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    print_report(report, max(batches), a.context)
    if a.json == "-":  # the whole report, last
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
