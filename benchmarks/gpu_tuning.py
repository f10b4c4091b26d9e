"""Launch settings of the Triton prefill kernel, timed side by side on a GPU
(``gpu_step.py --tune``): where the defaults of executor_gpu/cuda/triton_prefill.py come from.

Query x key tiles, warps, software-pipelining stages and the program order (a chunk's longest
tiles first or in order) at the prefill cases of gpu_prefill.py, reported in TFLOPS. (The decode
kernel's tiles and partitions are swept by ``gpu_step.py --sweep``.) Every time is a CUDA-graph
replay (no launch overhead); a setting the compiler rejects (shared memory) is reported as such
and the sweep goes on.
"""

from __future__ import annotations

import functools

import torch

from benchmarks.gpu_kernels import BLOCK, event_median_ms, graph_time_us
from benchmarks.gpu_prefill import attention_flops, step_meta

#: (block_m, block_n, warps, stages, longest first); the first is the kernel's launch before
#: the program order was added.
PREFILL_VARIANTS = [
    (128, 64, 8, 3, False),
    (128, 64, 8, 3, True),
    (128, 64, 8, 2, True),
    (128, 64, 8, 4, True),
    (128, 128, 8, 2, True),
    (128, 128, 8, 3, True),
    (128, 32, 4, 3, True),
    (64, 64, 4, 3, True),
    (64, 128, 4, 2, True),
]


def kernel_shape(device: torch.device) -> tuple[int, int, int, torch.dtype]:
    """(query heads, KV heads, head size, dtype): Llama-3-8B's in bf16 on CUDA, a small float32
    one for the CPU smoke run (Triton's interpreter)."""
    return (32, 8, 128, torch.bfloat16) if device.type == "cuda" else (4, 2, 32, torch.float32)


def timed_us(fn, device: torch.device) -> tuple[float | None, str]:
    """Microseconds per call of ``fn`` from graph replays (host time on the CPU), or
    (None, why) when it fails."""
    try:
        if device.type != "cuda":
            return event_median_ms(fn, iters=2, warmup=1) * 1e3, ""
        return graph_time_us(fn), ""
    except Exception as exc:  # (a setting past the shared memory: reported, not fatal)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return None, f"{type(exc).__name__}: {str(exc)[:120]}"


def tune_prefill(device: torch.device, cases: dict) -> list[dict]:
    """The prefill kernel over PREFILL_VARIANTS at ``cases`` (gpu_prefill.py's)."""
    from executor_gpu.cuda import triton_prefill as tp

    heads, kv_heads, dim, dtype = kernel_shape(device)
    default = (*tp.launch_settings(dim, dtype.itemsize, device)[0], tp.LONGEST_FIRST)
    rows = []
    for name, case in cases.items():
        meta = step_meta(case, device)
        t = meta.query_start_loc_host[-1]
        blocks = int(meta.block_tables.max()) + 1
        kv = torch.randn(2, blocks, BLOCK, kv_heads, dim, device=device).to(dtype)
        q = torch.randn(t, heads, dim, device=device).to(dtype)
        out = torch.empty_like(q)
        first = meta.num_decodes
        qsl = meta.query_start_loc_host
        longest = max(b - a for a, b in zip(qsl[first:-1], qsl[first + 1 :]))
        # The prefill chunks' share of the case's FLOPs (the decodes are the other kernel's).
        flops = attention_flops((case[0], 0, 0), heads, dim)
        for block_m, block_n, warps, stages, longest_first in PREFILL_VARIANTS:
            us, error = timed_us(
                functools.partial(
                    tp.paged_prefill_attention,
                    q,
                    kv,
                    meta.block_tables,
                    meta.seq_lens,
                    meta.query_start_loc,
                    dim**-0.5,
                    first,
                    meta.num_requests - first,
                    longest,
                    out,
                    block_m=block_m,
                    block_n=block_n,
                    warps=warps,
                    stages=stages,
                    longest_first=longest_first,
                ),
                device,
            )
            rows.append(
                {
                    "case": name,
                    "variant": f"m{block_m}_n{block_n}_w{warps}_s{stages}"
                    + ("_longest_first" if longest_first else "_in_order"),
                    "us": us,
                    "TFLOPS": flops / us / 1e6 if us else None,
                    "default": (block_m, block_n, warps, stages, longest_first) == default,
                    "error": error,
                }
            )
        del kv
    return rows


def print_tuning(report: dict) -> None:
    """One line per setting and case."""
    for r in report.get("tune_prefill") if isinstance(report.get("tune_prefill"), list) else []:
        figure = f"{r['us']:8.1f} us {r['TFLOPS']:7.1f} TFLOPS" if r["us"] else r["error"]
        mark = " (default)" if r["default"] else ""
        print(f"prefill {r['case']:>38} {r['variant']:>32}: {figure}{mark}")
