"""Decode-sized linear layers: cuBLAS against the Triton weight-streaming product, per shape.

For each linear layer of a Llama-3-8B decoder (q/k/v 4096 x 6144, o 4096 x 4096, gate/up
4096 x 28672, down 14336 x 4096; bf16) at a decode batch of rows, every launch setting in
``TILES`` with the weight stored [in, out] and [out, in] (``benchmarks/stream_linear.py``)
is timed beside cuBLAS on both layouts. Each figure is a CUDA-graph replay of eight products
over eight different weights (as eight layers: the weights come from memory, not the L2 cache),
per product, with the bandwidth it streams and its relative error against float64. Then the
best setting per shape and cuBLAS run as one decoder layer's four products over eight layers,
alternating for three rounds (``layer``: medians and their ratio), and the copy rate of the
device for reference. ``logits`` times the output layer's float32 logits at each batch, the
torch set's form against the CUDA set's (executor_gpu/cuda/triton_layer_ops.py), alternating.
``--smoke`` runs a tiny version on the CPU under Triton's interpreter.

    python benchmarks/gpu_linear.py --json /tmp/gpu_linear.json
    python benchmarks/gpu_linear.py --only logits --rows 1,16,64
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_kernels import copy_bandwidth, rel_err, time_us  # noqa: E402
from benchmarks.stream_linear import LinearTiles, fits, stream_linear  # noqa: E402
from common.torch.models.layer_ops import TORCH_LAYER_OPS  # noqa: E402
from executor_gpu.cuda.triton_layer_ops import CUDA_LAYER_OPS  # noqa: E402

SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096)}
SMOKE_SHAPES = {"qkv": (64, 96), "down": (128, 32)}
VOCAB, SMOKE_VOCAB = 128256, 500
TILES = [
    LinearTiles(64, 128, 1, 4, 4),
    LinearTiles(64, 128, 2, 4, 4),
    LinearTiles(64, 128, 4, 4, 4),
    LinearTiles(64, 256, 2, 8, 3),
    LinearTiles(32, 128, 1, 4, 4),
    LinearTiles(32, 256, 1, 4, 3),
    LinearTiles(32, 256, 2, 4, 3),
    LinearTiles(32, 512, 1, 4, 2),
    LinearTiles(16, 256, 1, 4, 3),
    LinearTiles(16, 512, 1, 4, 3),
    LinearTiles(16, 256, 2, 4, 3),
    LinearTiles(128, 128, 4, 8, 3),
    LinearTiles(128, 64, 2, 4, 4),
]
SMOKE_TILES = [LinearTiles(32, 32, 1, 4, 2), LinearTiles(16, 32, 2, 4, 2)]
LAYERS = 8  # weights per shape, one per simulated layer


def log(t0: float, *parts) -> None:
    print(f"[{time.perf_counter() - t0:7.1f}s]", *parts, flush=True)


def weights_for(k: int, n: int, out_in: bool, device, dtype, count: int) -> list[torch.Tensor]:
    """``count`` random [K, N] weights; with ``out_in`` each is the transposed view of an
    [out, in] tensor (each output column's weights contiguous)."""
    made = []
    for _ in range(count):
        w = torch.randn(n, k, device=device, dtype=dtype) * k**-0.5
        made.append(w.t() if out_in else w.t().contiguous())
    return made


def cublas(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """torch's product on either layout: ``mm`` on [in, out], ``F.linear`` on [out, in]."""
    return torch.nn.functional.linear(x, w.t()) if w.stride(0) == 1 else torch.mm(x, w)


def time_products(fn, x: torch.Tensor, weights: list[torch.Tensor], device) -> float:
    """Microseconds per product of ``fn(x, w)`` over ``weights`` in turn."""

    def run():
        for w in weights:
            fn(x, w)

    return time_us(run, device) / len(weights)


def sweep_shape(name, k, n, rows, tiles, device, dtype, t0) -> list[dict]:
    """Every setting and cuBLAS on both layouts for one shape: us, TB/s, relative error."""
    x = torch.randn(rows, k, device=device, dtype=dtype)
    out = []
    for out_in in (False, True):
        weights = weights_for(k, n, out_in, device, dtype, LAYERS if device.type == "cuda" else 1)
        ref = x.double() @ weights[0].double()
        layout = "out_in" if out_in else "in_out"
        candidates = [("cublas", None)] + [("triton", t) for t in tiles]
        for kind, t in candidates:
            if t is not None and not fits(x, weights[0], t):
                continue
            fn = cublas if t is None else (lambda a, w, t=t: stream_linear(a, w, None, t))
            row = {"shape": name, "rows": rows, "layout": layout, "kind": kind}
            if t is not None:
                row["tiles"] = [t.block_n, t.block_k, t.split, t.warps, t.stages]
            try:
                row["rel_err"] = rel_err(fn(x, weights[0]), ref)
                us = time_products(fn, x, weights, device)
                row.update(us=us, TBps=k * n * weights[0].element_size() / us / 1e6)
            except Exception as e:  # a setting the compiler refuses: recorded, the sweep goes on
                row["error"] = repr(e)[:300]
            out.append(row)
            log(t0, json.dumps(row))
    return out


def best_per_shape(rows: list[dict]) -> dict:
    """The fastest Triton row and the fastest cuBLAS row of each shape."""
    best: dict = {}
    for r in rows:
        if "us" not in r:
            continue
        slot = best.setdefault(r["shape"], {})
        if r["kind"] not in slot or r["us"] < slot[r["kind"]]["us"]:
            slot[r["kind"]] = r
    return best


def time_layer(best: dict, shapes: dict, rows: int, device, dtype, rounds: int) -> dict:
    """One layer's products (best Triton setting per shape, against cuBLAS on its best layout)
    over LAYERS layers, alternating ``rounds`` times: ms per layer and the ratio."""
    x_by_k = {k: torch.randn(rows, k, device=device, dtype=dtype) for k, _ in shapes.values()}

    def plan(kind):
        steps = []
        for name, (k, n) in shapes.items():
            r = best[name][kind]
            ws = weights_for(k, n, r["layout"] == "out_in", device, dtype, LAYERS)
            t = LinearTiles(*r["tiles"]) if kind == "triton" else None
            steps.append((x_by_k[k], ws, t))

        def run():
            for i in range(LAYERS):
                for x, ws, t in steps:
                    cublas(x, ws[i]) if t is None else stream_linear(x, ws[i], None, t)

        return run

    runs = {kind: plan(kind) for kind in ("cublas", "triton")}
    times: dict[str, list[float]] = {"cublas": [], "triton": []}
    for _ in range(rounds):
        for kind, run in runs.items():
            times[kind].append(time_us(run, device) / LAYERS / 1e3)
    med = {kind: statistics.median(v) for kind, v in times.items()}
    return {
        "rows": rows,
        "cublas_ms": med["cublas"],
        "triton_ms": med["triton"],
        "cublas_over_triton": med["cublas"] / med["triton"],
        "rounds": times,
    }


def time_logits(rows: int, hidden: int, vocab: int, device, dtype, rounds: int = 3) -> dict:
    """The float32 logits of ``rows`` hidden rows: the torch set's form against the CUDA set's,
    alternating ``rounds`` times (us, medians), and their largest difference."""
    h = torch.randn(rows, hidden, device=device, dtype=dtype)
    w = (torch.randn(vocab, hidden, device=device) * hidden**-0.5).to(dtype)
    forms = {"torch": TORCH_LAYER_OPS, "cuda": CUDA_LAYER_OPS}
    prepared = {name: ops.prepare_logits(w) for name, ops in forms.items()}
    times: dict[str, list[float]] = {name: [] for name in forms}
    for _ in range(rounds):
        for name, ops in forms.items():
            times[name].append(time_us(lambda o=ops, p=prepared[name]: o.logits(h, p), device))
    out = {name: forms[name].logits(h, prepared[name]) for name in forms}
    med = {name: statistics.median(v) for name, v in times.items()}
    return {
        "rows": rows,
        "torch_us": med["torch"],
        "cuda_us": med["cuda"],
        "torch_over_cuda": med["torch"] / med["cuda"],
        "max_abs_diff": float((out["torch"] - out["cuda"]).abs().max()),
        "rounds": times,
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="64", help="decode batch sizes, comma-separated")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    p.add_argument("--only", default="", help="one section: sweep or logits (default: both)")
    p.add_argument("--json", default="", help="write the report here")
    a = p.parse_args(argv)
    device = torch.device("cpu" if a.smoke else "cuda")
    dtype = torch.float32 if a.smoke else torch.bfloat16
    shapes, tiles = (SMOKE_SHAPES, SMOKE_TILES) if a.smoke else (SHAPES, TILES)
    t0 = time.perf_counter()
    report: dict = {"device": torch.cuda.get_device_name() if not a.smoke else "cpu"}
    if not a.smoke:
        report["copy_TBps"] = copy_bandwidth(device) / 1e12
        log(t0, "copy_TBps", report["copy_TBps"])
    report["sweep"], report["layer"], report["logits"] = [], [], []
    for rows in [int(r) for r in a.rows.split(",")]:
        if a.only in ("", "logits"):
            hidden, vocab = (64, SMOKE_VOCAB) if a.smoke else (4096, VOCAB)
            report["logits"].append(time_logits(rows, hidden, vocab, device, dtype))
            log(t0, "logits", json.dumps(report["logits"][-1]))
        if a.only not in ("", "sweep"):
            continue
        batch_rows = []
        for name, (k, n) in shapes.items():
            batch_rows += sweep_shape(name, k, n, rows, tiles, device, dtype, t0)
        report["sweep"] += batch_rows
        try:
            best = best_per_shape(batch_rows)
            layer = time_layer(best, shapes, rows, device, dtype, rounds=3)
            layer["best"] = best
            report["layer"].append(layer)
            log(t0, "layer", json.dumps(layer))
        except Exception:
            traceback.print_exc()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
