"""Tensor parallelism's cost: the decode step at TP=1 and TP=N in one run, and the traffic.

1. Measured: the decode forward pass + logits (the model part of a step, fabricated cache
   contents) of the GPU executor's runner at ``--tensor-parallel-size 1`` and N, on the same
   device kind, in the same script, reported as a ratio (TP=N time / TP=1 time). On the CPU
   both runs share the host's cores (N ranks of cores/N threads each against one rank of all of
   them), so the ratio there is the collectives' and the extra processes' overhead, not a
   speed-up; on a host of N GPUs it is the speed-up.
2. Modelled: the bytes each rank sends per step (two all-reduces of [tokens, hidden] per layer,
   one for the embedding, and its slice of the logits gathered to rank 0) and their time at the
   interconnects' datasheet bandwidths, for Llama-3-8B and Llama-3-70B shapes at TP 2/4/8.

    python benchmarks/tp_step.py --tensor-parallel-size 2 --json /tmp/tp_step.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_kernels import BLOCK, event_median_ms, fabricated_meta  # noqa: E402
from common.host.settings import ExecutorConfig  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from executor_gpu.follower import start_sharded_runner  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402

#: Model shapes (config.json) for the measured run and the traffic model.
SHAPES = {
    "smollm-135m": dict(hidden=576, inter=1536, layers=30, heads=9, kv=3, vocab=49152),
    "llama3-8b": dict(hidden=4096, inter=14336, layers=32, heads=32, kv=8, vocab=128256),
    "llama3-70b": dict(hidden=8192, inter=28672, layers=80, heads=64, kv=8, vocab=128256),
}
#: Per-device, per-direction interconnect bandwidth, bytes/s (datasheets: NVLink 4 on
#: H100/H200 SXM 900 GB/s both directions; TPU v5e ICI 1,600 Gbit/s and v5p 4,800 Gbit/s per
#: chip, taken here as both directions together, i.e. half each way).
LINKS = {"NVLink4 (H200)": 450e9, "ICI v5e": 100e9, "ICI v5p": 300e9}


def config_json(shape: dict) -> dict:
    """A Llama config.json of ``shape``."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": shape["vocab"],
        "hidden_size": shape["hidden"],
        "intermediate_size": shape["inter"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "eos_token_id": 0,
    }


def traffic_bytes(shape: dict, tokens: int, sampled: int, size: int, dtype_bytes: int) -> int:
    """Bytes one rank sends in a step of ``tokens`` tokens (``sampled`` rows projected to
    logits) over ``size`` ranks: a ring all-reduce sends 2 (N-1)/N of the tensor per rank; each
    layer has two ([tokens, hidden], attention and MLP outputs), the embedding one; each
    follower sends its float32 [sampled, vocab / N] logits to rank 0."""
    if size == 1:
        return 0
    tensor = tokens * shape["hidden"] * dtype_bytes
    all_reduce = 2 * (size - 1) / size * tensor
    logits = sampled * -(-shape["vocab"] // size) * 4
    return int((2 * shape["layers"] + 1) * all_reduce + logits)


def traffic_table(dtype_bytes: int = 2) -> list[dict]:
    """The modelled traffic of a decode step (64 requests) and of a 2,048-token prefill chunk,
    per rank, with its time at each link's bandwidth (no latency term: each collective also
    costs its launch and synchronization, several microseconds, which dominates small decode
    steps)."""
    rows = []
    for name in ("llama3-8b", "llama3-70b"):
        for tokens, sampled, what in ((64, 64, "decode x64"), (2048, 1, "prefill 2048")):
            for size in (2, 4, 8):
                sent = traffic_bytes(SHAPES[name], tokens, sampled, size, dtype_bytes)
                row = {"model": name, "step": what, "tp": size, "MB_per_rank": sent / 1e6}
                row.update({link: sent / bw * 1e6 for link, bw in LINKS.items()})  # microseconds
                rows.append(row)
    return rows


def build_runner(path: str, device: torch.device, size: int, batch: int, context: int):
    """A runner over ``size`` ranks with dummy weights and room for the fabricated steps."""
    cfg = ExecutorConfig(
        model=path,
        device=str(device),
        dtype="float32" if device.type == "cpu" else "bfloat16",
        max_num_seqs=batch,
        max_model_len=2048,
        load_format="dummy",
        tensor_parallel_size=size,
    )
    geometry = load_model_geometry(path, cfg.max_model_len)
    if size == 1:
        runner = GPUModelRunner(cfg, geometry)
    else:
        runner = start_sharded_runner(cfg, geometry, device)
    runner.load_model()
    runner.initialize_kv_cache(1 + batch * -(-(context + 1) // BLOCK))
    return runner


def time_decode(runner: GPUModelRunner, batches: list[int], context: int) -> dict[int, float]:
    """Median ms of the decode forward + logits per batch size."""
    out = {}
    device = runner.device
    with torch.inference_mode():
        for batch in batches:
            meta = fabricated_meta(batch, context, device)
            ids = torch.randint(0, runner.geometry.vocab_size, (batch,), device=device)
            pos = torch.full((batch,), context - 1, device=device)
            out[batch] = event_median_ms(
                lambda i=ids, p=pos, m=meta: runner.decode_forward(i, p, m), iters=10
            )
    return out


def measure(shape: str, size: int, batches: list[int], context: int) -> tuple[list[dict], list]:
    """TP=1 and TP=size decode times on this host's device kind, with their ratio; and the
    rank groups started, for the caller to close once the results are out."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda" and torch.cuda.device_count() < size:
        print(f"{torch.cuda.device_count()} CUDA device(s): TP={size} not measured")
        sizes = [1]
    else:
        sizes = [1, size]
    times, groups = {}, []
    with tempfile.TemporaryDirectory() as path:
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config_json(SHAPES[shape]), f)
        for n in sizes:
            threads = torch.get_num_threads()
            runner = build_runner(path, device, n, max(batches), context)
            times[n] = time_decode(runner, batches, context)
            if runner.ranks is not None:
                groups.append(runner.ranks)
            torch.set_num_threads(threads)
    measured = [
        {
            "batch": b,
            "context": context,
            "tp1_ms": times[1][b],
            f"tp{size}_ms": times.get(size, {}).get(b),
            "ratio": times[size][b] / times[1][b] if size in times else None,
        }
        for b in batches
    ]
    return measured, groups


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensor-parallel-size", type=int, default=2)
    p.add_argument("--shape", default="smollm-135m", choices=sorted(SHAPES))
    p.add_argument("--batch-sizes", default="1,16,64")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    batches = [int(b) for b in a.batch_sizes.split(",")]
    measured, groups = measure(a.shape, a.tensor_parallel_size, batches, a.context)
    modelled = traffic_table()
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"measured": measured, "modelled": modelled}, f, indent=1)
    n = a.tensor_parallel_size
    print(f"\n{a.shape}, decode forward + logits, context {a.context}:")
    for r in measured:
        ratio = f"{r['ratio']:.2f}x" if r["ratio"] is not None else "-"
        tp_ms = r[f"tp{n}_ms"]
        tp_text = f"{tp_ms:.2f}" if tp_ms is not None else "-"
        print(f"  batch {r['batch']:>3}: TP=1 {r['tp1_ms']:.2f} ms, TP={n} {tp_text} ms ({ratio})")
    print("\nmodelled traffic per rank per step (bf16 activations, float32 logits):")
    print("| model | step | TP | MB/rank | " + " | ".join(f"{k} us" for k in LINKS) + " |")
    print("|---|---|---|---|" + "---|" * len(LINKS))
    for r in modelled:
        links = " | ".join(f"{r[k]:.0f}" for k in LINKS)
        print(f"| {r['model']} | {r['step']} | {r['tp']} | {r['MB_per_rank']:.2f} | {links} |")
    sys.stdout.flush()
    for group in groups:
        group.close()


if __name__ == "__main__":
    main()
    # The results are out and the followers gone. End without the interpreter's teardown:
    # destroying torch's C++ state after a gloo group can abort on one of gloo's threads
    # ("terminate called without an active exception"), as executor_gpu/follower.py notes.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
