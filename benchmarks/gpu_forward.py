"""The decode forward pass + logits of the GPU runner, timed for benchmarks/gpu_step.py: per
variant (torch operators eager, fused kernels eager, fused kernels replayed from CUDA graphs),
graphs recaptured over another BLAS library or other layer ops, and the device time of one
replay per kernel (CUPTI)."""

from __future__ import annotations

import dataclasses

import torch

from benchmarks.gpu_kernels import event_median_ms, fabricated_meta
from common.torch.models.layer_ops import TORCH_LAYER_OPS
from executor_gpu.model_runner import GPUModelRunner


def time_forward(
    runner: GPUModelRunner, batches: list[int], context: int, graph_name: str = ""
) -> list[dict]:
    """Decode forward + logits per variant and batch size (fabricated cache contents); with
    ``graph_name``, only the graph replay, reported under that name."""
    model, device = runner.model, runner.device
    variants = [
        ("torch", TORCH_LAYER_OPS, "torch", False),
        ("fused", runner.fused_ops, runner.attention_backend, False),
        ("graph", runner.fused_ops, runner.attention_backend, True),
    ]
    if graph_name:
        variants = [(graph_name, runner.fused_ops, runner.attention_backend, True)]
    if runner.tp.size > 1:  # the ranks run the ops they loaded with, eagerly (no graphs)
        variants = [("fused", runner.fused_ops or TORCH_LAYER_OPS, runner.attention_backend, False)]
    rows = []
    with torch.inference_mode():
        for batch in batches:
            meta = fabricated_meta(batch, context, device)
            ids = torch.randint(0, runner.geometry.vocab_size, (batch,), device=device)
            pos = torch.full((batch,), context - 1, device=device)
            for name, ops, backend, graphed in variants:
                if ops is None or (
                    name == "torch"
                    and runner.fused_ops is not None
                    and runner.fused_ops.prepare_linear is not ops.prepare_linear
                ):
                    continue  # (the CPU's fused ops repack the weights: no torch variant)
                if model.layer_ops is not ops:
                    model.set_layer_ops(ops)
                model.set_attention_backend(backend)
                if graphed:
                    ms = event_median_ms(lambda i=ids, p=pos, m=meta: runner.graphs.run(i, p, m))
                else:
                    meta.derived.clear()
                    ms = event_median_ms(
                        lambda i=ids, p=pos, m=meta: runner.decode_forward(i, p, m), iters=10
                    )
                rows.append({"batch": batch, "context": context, "variant": name, "ms": ms})
    if model.layer_ops is not (runner.fused_ops or TORCH_LAYER_OPS):
        model.set_layer_ops(runner.fused_ops or TORCH_LAYER_OPS)
    model.set_attention_backend(runner.attention_backend)
    return rows


def out_in_ops(ops):
    """``ops`` with linear weights stored [out, in] and multiplied by ``F.linear`` (cuBLAS's
    "TN" product) instead of the model's [in, out] ``torch.mm``."""
    import torch.nn.functional as F

    return dataclasses.replace(
        ops,
        name=ops.name + "_out_in",
        prepare_linear=lambda w: w.t().contiguous(),
        linear=lambda x, w, b: F.linear(x, w, b),
    )


def recaptured_rows(
    runner: GPUModelRunner, batches: list[int], context: int, name: str, blas: str = "", ops=None
) -> list[dict]:
    """Graph replay after recapturing with torch's GEMMs on another BLAS library or with other
    layer ops; the BLAS choice is restored after (the ops are not: run this last for them)."""
    default = torch.backends.cuda.preferred_blas_library()
    if blas:
        torch.backends.cuda.preferred_blas_library(blas)
    if ops is not None:
        runner.fused_ops = ops
        runner.model.set_layer_ops(ops)
    try:
        runner.enable_decode_graphs()
        return time_forward(runner, batches, context, graph_name=name)
    finally:
        torch.backends.cuda.preferred_blas_library(default)


def profile_replay(runner: GPUModelRunner, batch: int, context: int) -> list[dict]:
    """Device time per kernel name over 5 graph replays of a decode step (CUPTI sees the
    kernels inside graphs), largest first."""
    from torch.profiler import ProfilerActivity, profile

    meta = fabricated_meta(batch, context, runner.device)
    ids = torch.zeros(batch, dtype=torch.long, device=runner.device)
    pos = torch.full((batch,), context - 1, device=runner.device)
    with torch.inference_mode():
        runner.graphs.run(ids, pos, meta)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.graphs.run(ids, pos, meta)
            torch.cuda.synchronize()
    rows = [
        {"kernel": e.key[:90], "calls": e.count // 5, "us_per_step": e.device_time_total / 5}
        for e in prof.key_averages()
        if e.device_time_total > 0
    ]
    return sorted(rows, key=lambda r: -r["us_per_step"])[:16]
