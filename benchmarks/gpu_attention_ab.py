"""The CUDA attention kernels against an earlier version of themselves, in one run.

``--base-dir`` holds the earlier ``triton_prefill.py`` and ``triton_attention.py`` (e.g. from
``git show COMMIT:executor_gpu/cuda/triton_prefill.py``); both versions run on the same inputs,
alternating for ``--rounds`` rounds, each time a CUDA-graph replay; the medians, their ratio,
the spread and the relative difference of the outputs are printed. Prefill at gpu_prefill.py's
cases, decode at a few (batch, context) shapes; bf16, Llama-3-8B heads. ``--smoke`` runs it on
the CPU under Triton's interpreter (tiny shapes, host time) so that CI keeps it working.

    mkdir -p /tmp/base && for f in triton_prefill triton_attention; do
        git show HEAD~1:executor_gpu/cuda/$f.py > /tmp/base/$f.py; done
    python benchmarks/gpu_attention_ab.py --base-dir /tmp/base
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from benchmarks.gpu_kernels import attention_shape, decode_inputs, rel_err, time_us  # noqa: E402
from benchmarks.gpu_prefill import (  # noqa: E402
    CASES,
    SMOKE_CASES,
    attention_flops,
    prefill_inputs,
    prefill_span,
)

DECODE_SHAPES = ((64, 256), (64, 512), (64, 1024), (16, 256), (1, 1024))
SMOKE_DECODE_SHAPES = ((3, 40),)


def load_base(base_dir: str, name: str):
    """The module ``name`` of the earlier version, loaded from ``base_dir/name.py``."""
    spec = importlib.util.spec_from_file_location(
        f"base_{name}", os.path.join(base_dir, name + ".py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compare(fns: dict, rounds: int, device: torch.device) -> dict:
    """Alternating timings of ``fns`` ({"base": f, "new": f}): medians (us), ratio, spread."""
    times: dict[str, list[float]] = {"base": [], "new": []}
    for _ in range(rounds):
        for label in ("base", "new"):
            times[label].append(time_us(fns[label], device))
    base, new = statistics.median(times["base"]), statistics.median(times["new"])
    return {
        "base_us": base,
        "new_us": new,
        "base_over_new": base / new,
        "spread_us": {k: [min(v), max(v)] for k, v in times.items()},
    }


def prefill_rows(modules: dict, cases: dict, rounds: int, device: torch.device) -> list[dict]:
    """Each prefill case through both versions of ``paged_prefill_attention``."""
    heads, _, dim, _ = attention_shape(device)
    rows = []
    for name, case in cases.items():
        meta, kv, q, _, _ = prefill_inputs(case, device)
        fns, outs = {}, {}
        for label, module in modules.items():
            outs[label] = torch.zeros_like(q)
            fns[label] = functools.partial(
                module.paged_prefill_attention, q, kv, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, dim**-0.5, *prefill_span(meta), outs[label],
            )  # fmt: skip
            fns[label]()
        row = {"kernel": "prefill", "case": name, **compare(fns, rounds, device)}
        flops = attention_flops((case[0], 0, 0), heads, dim)
        row["base_TFLOPS"] = flops / row["base_us"] / 1e6
        row["new_TFLOPS"] = flops / row["new_us"] / 1e6
        first = meta.query_start_loc_host[meta.num_decodes]  # (the decodes' rows are not written)
        row["output_diff"] = rel_err(outs["new"][first:], outs["base"][first:])
        rows.append(row)
    return rows


def decode_rows(modules: dict, shapes, rounds: int, device: torch.device) -> list[dict]:
    """Each (batch, context) decode shape through both versions of
    ``paged_decode_attention``."""
    _, kv_heads, dim, dtype = attention_shape(device)
    rows = []
    for batch, context in shapes:
        meta, kv, q = decode_inputs(batch, context, device)
        fns = {
            label: functools.partial(
                module.paged_decode_attention, q, kv, meta.block_tables, meta.seq_lens, dim**-0.5
            )
            for label, module in modules.items()
        }
        row = {"kernel": "decode", "case": f"b{batch}_ctx{context}", **compare(fns, rounds, device)}
        kv_bytes = 2 * batch * context * kv_heads * dim * dtype.itemsize
        row["base_TBps"] = kv_bytes / row["base_us"] / 1e6
        row["new_TBps"] = kv_bytes / row["new_us"] / 1e6
        row["output_diff"] = rel_err(fns["new"](), fns["base"]())
        rows.append(row)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--base-dir", required=True, help="the earlier triton_*.py files")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    p.add_argument("--json", default="")
    a = p.parse_args(argv)
    smoke = a.smoke or not torch.cuda.is_available()
    device = torch.device("cpu" if smoke else "cuda", None if smoke else 0)
    from executor_gpu.cuda import triton_attention, triton_prefill

    prefill = {"base": load_base(a.base_dir, "triton_prefill"), "new": triton_prefill}
    decode = {"base": load_base(a.base_dir, "triton_attention"), "new": triton_attention}
    rows = prefill_rows(prefill, SMOKE_CASES if smoke else CASES, a.rounds, device)
    rows += decode_rows(decode, SMOKE_DECODE_SHAPES if smoke else DECODE_SHAPES, a.rounds, device)
    for r in rows:
        rate = "TFLOPS" if r["kernel"] == "prefill" else "TBps"
        print(
            f"{r['kernel']:>7} {r['case']:>38}: base {r['base_us']:8.1f} us "
            f"{r['base_' + rate]:7.2f} {rate} | new {r['new_us']:8.1f} us "
            f"{r['new_' + rate]:7.2f} {rate} | base/new {r['base_over_new']:.3f} | "
            f"outputs differ by {r['output_diff']:.1e}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": str(device), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
