"""The CPU executor's step time with and without its C++ kernels, in one process.

Builds one ``GPUModelRunner`` per variant on the CPU and times the same steps on each,
alternating between variants so that a shared machine's noise falls on all of them alike:

- ``torch``: torch operators only (``TANDEM_CPU_KERNELS=0``: the reference path);
- ``fused``: the C++ attention and layer ops, linear layers on torch's GEMM;
- ``packed``: everything, linear layers on the packed-panel kernel (what the executor runs);
- ``packed_fma``: ``packed`` with bf16's linear layers on the float32-FMA fallback
  (``TANDEM_CPU_BF16_DOT=0``) instead of the AVX-512 bf16 dot products (same as ``packed`` in
  float32, or on a CPU without them);
- ``packed_torch_scan``: ``packed`` with the logits' finiteness check and greedy argmax in
  torch (two single-threaded passes) instead of the kernels' one-pass scan.

With ``--dtype float32,bfloat16`` each variant runs in each dtype (bf16 weights, activations
and KV cache; labels ``packed-bf16`` etc.), so that one run gives bf16's throughput as a ratio
of float32's on the same machine at the same moment.

For each batch size B it prefills B requests of ``--context`` tokens, then runs ``--steps``
decode steps (one token per request) and reports the median step, tokens/s and each variant's
speedup over the first (``torch`` in float32 by default).

With ``--kernel-times`` it instead times each kernel of a decode step alone at the model's
shapes (every layer's call, random weights and a random cache of ``--context`` tokens per
request, each request's blocks its own), in CPU seconds on one thread, so that a loaded
machine's other jobs change the figures less than they change wall time; ``--hot`` makes every
request share its blocks (the cache read from the CPU's caches: the arithmetic alone).

    python benchmarks/cpu_step.py --batch-sizes 1,16,64 --json /tmp/cpu_step.json
    python benchmarks/cpu_step.py --variants packed --dtype float32,bfloat16
    python benchmarks/cpu_step.py --kernel-times --dtype float32,bfloat16 --batch-sizes 16,64
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from common.host.settings import ExecutorConfig  # noqa: E402
from common.wire.model_config import load_model_geometry, read_model_config  # noqa: E402
from common.wire.step_types import (  # noqa: E402
    CachedRequestData,
    NewRequestData,
    SamplingParams,
    StepInput,
    StepOutput,
)
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402
from tests.support.processes import model_dir  # noqa: E402

VARIANTS = ("torch", "fused", "packed")  # the default set; the others on request


def build_runner(
    model: str, variant: str, num_blocks: int, dtype: str = "float32"
) -> GPUModelRunner:
    """A CPU runner with the variant's kernels in ``dtype``, its KV cache allocated."""
    os.environ["TANDEM_CPU_KERNELS"] = "0" if variant == "torch" else "1"
    os.environ["TANDEM_CPU_BF16_DOT"] = "0" if variant == "packed_fma" else "1"
    try:
        runner = GPUModelRunner(
            ExecutorConfig(model=model, device="cpu", dtype=dtype), load_model_geometry(model)
        )
    finally:
        os.environ.pop("TANDEM_CPU_KERNELS")
        os.environ.pop("TANDEM_CPU_BF16_DOT")
    if variant == "fused" and runner.fused_ops is not None:
        runner.fused_ops = dataclasses.replace(
            runner.fused_ops, prepare_linear=lambda weight: weight
        )
    if variant == "packed_torch_scan":
        runner.scan_logits = None
    runner.load_model()
    runner.initialize_kv_cache(num_blocks)
    return runner


def _checked(output: StepOutput, requests: int) -> None:
    """Raise unless the step ran and sampled every one of its ``requests``."""
    errors = [o.error for o in output.outputs if o.error]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed in the step: {errors[0]}")
    sampled = (
        [t for t in output.sampled_token_ids if t >= 0]
        if output.sampled_token_ids is not None
        else [o for o in output.outputs if o.sampled_token_id is not None]
    )
    if len(sampled) != requests:
        raise RuntimeError(f"the step sampled {len(sampled)} of its {requests} requests")


def prefill(runner: GPUModelRunner, batch: int, context: int, blocks_each: int) -> float:
    """Start ``batch`` requests with ``context`` prompt tokens; the seconds their steps took.

    As many requests per step as the runner's step limits take (a step over them would fail
    its extra requests, and the decode steps would then run a smaller batch than asked)."""
    runner.reset()
    limits = runner.step_limits()
    per_step = max(1, min(limits.max_num_seqs, limits.max_tokens_per_step // context))
    if context > limits.max_tokens_per_step:
        raise ValueError(f"--context over the step limit of {limits.max_tokens_per_step}")
    new = [
        NewRequestData(
            f"r{i}",
            [(7 * i + j) % 1000 + 10 for j in range(context)],
            [],
            SamplingParams(),
            list(range(1 + i * blocks_each, 1 + (i + 1) * blocks_each)),
            0,
            context,
        )
        for i in range(batch)
    ]
    seconds = 0.0
    for first in range(0, batch, per_step):
        chunk = new[first : first + per_step]
        started = time.perf_counter()
        output = runner.execute_model(StepInput(first, new_requests=chunk))
        seconds += time.perf_counter() - started
        _checked(output, len(chunk))
    return seconds


def decode(runner: GPUModelRunner, batch: int, context: int, step: int) -> float:
    """One decode step of every request (its ``step``-th); its seconds."""
    cached = [CachedRequestData(f"r{i}", [], context + step - 1, 1) for i in range(batch)]
    started = time.perf_counter()
    output = runner.execute_model(StepInput(batch + step, cached_requests=cached))
    seconds = time.perf_counter() - started
    _checked(output, batch)
    return seconds


def cpu_ms(fn, repeats: int = 7) -> float:
    """Median CPU milliseconds of ``fn()`` in this process."""
    times = []
    for _ in range(repeats):
        started = time.process_time()
        fn()
        times.append(time.process_time() - started)
    return statistics.median(times) * 1e3


def kernel_times(model: str, batch: int, context: int, dtype: torch.dtype, hot: bool) -> dict:
    """CPU ms per decode step of each kernel class (every layer's call) at ``model``'s shapes."""
    from executor_gpu.cpu.kernels import bf16_dot_enabled, load_kernels

    m = load_kernels()
    cfg = read_model_config(model)
    hidden, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    dim = cfg.get("head_dim") or hidden // heads
    dot = dtype == torch.bfloat16 and bf16_dot_enabled(m)

    def weight(i: int, o: int) -> torch.Tensor:
        return m.pack_linear_weight((torch.randn(i, o) * 0.02).to(dtype), dot)

    shapes = {
        "qkv": (hidden, (heads + 2 * kv_heads) * dim),
        "o": (heads * dim, hidden),
        "gate_up": (hidden, 2 * inter),
        "down": (inter, hidden),
    }
    bs, nb = 16, -(-context // 16)
    blocks = 1 + (nb if hot else batch * nb)
    table = torch.arange(1, 1 + batch * nb).view(batch, nb)
    tables = (torch.arange(1, 1 + nb).repeat(batch, 1) if hot else table).int()
    lens = torch.full((batch,), context, dtype=torch.int32)
    starts = torch.arange(batch + 1, dtype=torch.int32)
    caches = [torch.randn(2, blocks, bs, kv_heads, dim).to(dtype) for _ in range(layers)]
    q = torch.randn(batch, heads, dim).to(dtype)
    scale = dim**-0.5
    times = {
        "attention": cpu_ms(
            lambda: [
                m.paged_attention(q, None, None, None, c, tables, lens, starts, scale, dot)
                for c in caches
            ]
        )
    }
    for name, (i, o) in shapes.items():
        ws, rows = [weight(i, o) for _ in range(layers)], torch.randn(batch, i).to(dtype)
        times[name] = cpu_ms(lambda ws=ws, rows=rows: [m.packed_linear(rows, w, None) for w in ws])
    gate_up = torch.randn(batch, 2 * inter).to(dtype)
    times["silu_and_mul"] = cpu_ms(lambda: [m.silu_and_mul(gate_up) for _ in range(layers)])
    x, res, norm = (
        torch.randn(batch, hidden).to(dtype),
        torch.randn(batch, hidden).to(dtype),
        torch.ones(hidden, dtype=dtype),
    )
    times["add_rms_norm"] = cpu_ms(
        lambda: [m.add_rms_norm_(x, res, norm, 1e-5) for _ in range(2 * layers)]
    )
    embedding = weight(hidden, cfg["vocab_size"])
    times["logits"] = cpu_ms(lambda: m.packed_linear(x, embedding, None).float())
    logits = m.packed_linear(x, embedding, None).float()
    times["logits_scan"] = cpu_ms(lambda: m.scan_logits(logits))
    # What the scan replaced (not part of the step, so not in the total): torch's two passes.
    times["logits_scan_torch"] = cpu_ms(
        lambda: (logits.sum(dim=-1).isfinite(), logits.argmax(dim=-1))
    )
    return times


def run_kernel_times(a: argparse.Namespace, sizes: list[int], dtypes: list[str]) -> None:
    """--kernel-times: one thread, each dtype and batch size, a row of CPU ms per kernel."""
    torch.set_num_threads(1)
    results = []
    for d in dtypes:
        for batch in sizes:
            t = kernel_times(a.model, batch, a.context, getattr(torch, d), a.hot)
            results.append({"dtype": d, "batch": batch, "context": a.context, "cpu_ms": t})
            cells = " ".join(f"{k} {v:.1f}" for k, v in t.items())
            total = sum(v for k, v in t.items() if not k.endswith("_torch"))
            print(f"{d:>9} batch {batch:>3}: total {total:6.1f} ms | {cells}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"kernel_times": results, "hot": a.hot}, f, indent=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=model_dir())
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=10, help="decode steps timed per batch size")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument(
        "--dtype", default="float32", help="dtypes to run each variant in, e.g. float32,bfloat16"
    )
    p.add_argument("--kernel-times", action="store_true", help="CPU ms per kernel, one thread")
    p.add_argument("--hot", action="store_true", help="--kernel-times: requests share blocks")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    sizes = [int(b) for b in a.batch_sizes.split(",")]
    dtypes = a.dtype.split(",")
    if a.kernel_times:
        with torch.inference_mode():
            return run_kernel_times(a, sizes, dtypes)
    blocks_each = -(-(a.context + a.steps + 1) // 16)
    num_blocks = 1 + max(sizes) * blocks_each
    runners = {
        label(v, d, dtypes): build_runner(a.model, v, num_blocks, d)
        for d in dtypes
        for v in a.variants.split(",")
    }
    variants = list(runners)
    results = []
    with torch.inference_mode():
        for batch in sizes:
            pre = {v: prefill(r, batch, a.context, blocks_each) for v, r in runners.items()}
            steps: dict[str, list[float]] = {v: [] for v in variants}
            for step in range(1, a.steps + 1):
                for v, r in runners.items():
                    steps[v].append(decode(r, batch, a.context, step))
            for v in variants:
                med = statistics.median(steps[v])
                results.append(
                    {
                        "batch": batch,
                        "variant": v,
                        "dtype": str(runners[v].dtype).removeprefix("torch."),
                        "decode_step_ms": med * 1e3,
                        "decode_tok_s": batch / med,
                        "prefill_s": pre[v],
                    }
                )
    base = {(r["batch"]): r["decode_step_ms"] for r in results if r["variant"] == variants[0]}
    print(
        f"{'batch':>5} {'variant':>11} {'step ms':>8} {'tok/s':>7} {'prefill s':>9} "
        f"{variants[0] + '/x':>9}"
    )
    for r in results:
        r["speedup"] = base[r["batch"]] / r["decode_step_ms"]
        print(
            f"{r['batch']:>5} {r['variant']:>11} {r['decode_step_ms']:>8.1f} "
            f"{r['decode_tok_s']:>7.1f} {r['prefill_s']:>9.2f} {r['speedup']:>9.2f}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"context": a.context, "steps": a.steps, "results": results}, f, indent=1)


def label(variant: str, dtype: str, dtypes: list[str]) -> str:
    """The variant's name, with its dtype when several are compared (packed-bf16)."""
    short = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}.get(dtype, dtype)
    return variant if len(dtypes) == 1 else f"{variant}-{short}"


if __name__ == "__main__":
    main()
