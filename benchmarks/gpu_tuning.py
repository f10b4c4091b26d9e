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

from benchmarks.gpu_kernels import attention_shape, time_us
from benchmarks.gpu_prefill import attention_flops, prefill_inputs, prefill_span

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


def tune_prefill(device: torch.device, cases: dict) -> list[dict]:
    """The prefill kernel over PREFILL_VARIANTS at ``cases`` (gpu_prefill.py's)."""
    from executor_gpu.cuda import triton_prefill as tp

    heads, _, dim, dtype = attention_shape(device)
    default = (*tp.launch_settings(dim, dtype.itemsize, device)[0], tp.LONGEST_FIRST)
    rows = []
    for name, case in cases.items():
        meta, kv, q, _, _ = prefill_inputs(case, device)
        out = torch.empty_like(q)
        # The prefill chunks' share of the case's FLOPs (the decodes are the other kernel's).
        flops = attention_flops((case[0], 0, 0), heads, dim)
        for block_m, block_n, warps, stages, longest_first in PREFILL_VARIANTS:
            call = functools.partial(
                tp.paged_prefill_attention, q, kv, meta.block_tables, meta.seq_lens,
                meta.query_start_loc, dim**-0.5, *prefill_span(meta), out, block_m=block_m,
                block_n=block_n, warps=warps, stages=stages, longest_first=longest_first,
            )  # fmt: skip
            try:
                us, error = time_us(call, device), ""
            except Exception as exc:  # (a setting past the shared memory: reported, not fatal)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                us, error = None, f"{type(exc).__name__}: {str(exc)[:120]}"
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
