"""Device-level measurements and checks for benchmarks/gpu_step.py: the copy bandwidth, the
Triton kernels against the torch reference, the attention kernel's partition/tile sweep and the
linear layers' cuBLAS bandwidth, plus the timing helpers (CUDA events, graph replay)."""

from __future__ import annotations

import functools
import statistics
import time

import torch

from common.torch.attention import AttentionMetadata, _decode_attention
from common.torch.models.layer_ops import TORCH_LAYER_OPS

BLOCK = 16  # tokens per KV block


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| in float64 (NaN anywhere gives NaN)."""
    got, ref = got.double(), ref.double()
    return float((got - ref).norm() / ref.norm())


def event_median_ms(fn, iters: int = 30, warmup: int = 3) -> float:
    """Median milliseconds of fn() by CUDA events (host clock + sync on the CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 2 GiB, bytes read + written per second."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = event_median_ms(lambda: dst.copy_(src), iters=10)
    return 2 * src.numel() / (ms / 1e3)


def fabricated_meta(
    batch: int, context: int | list[int], device: torch.device
) -> AttentionMetadata:
    """A decode step of ``batch`` requests at ``context`` tokens (one length for all, or one per
    request), each request on its own consecutive blocks from block 1."""
    lengths = list(context) if isinstance(context, list) else [context] * batch
    per = [-(-n // BLOCK) for n in lengths]
    tables = torch.zeros(batch, max(per), dtype=torch.long)
    first = 1
    for i, p in enumerate(per):
        tables[i, :p] = torch.arange(first, first + p)
        first += p
    tables = tables.to(device)
    pos = torch.tensor(lengths, device=device) - 1
    slots = tables.gather(1, (pos // BLOCK)[:, None])[:, 0] * BLOCK + pos % BLOCK
    return AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, device=device),
        seq_lens=torch.tensor(lengths, device=device),
        block_tables=tables,
        block_size=BLOCK,
        num_decodes=batch,
        max_decode_seq_len=max(lengths),
        query_start_loc_host=list(range(batch + 1)),
        seq_lens_host=lengths,
    )


def check_kernels(device: torch.device) -> dict:
    """Relative errors of the Triton kernels against the torch reference on the GPU."""
    from executor_gpu.cuda import triton_attention
    from executor_gpu.cuda import triton_layer_ops as ops

    out = {}
    gen = torch.Generator(device=device).manual_seed(0)
    lens = torch.randint(1, 700, (24,), generator=gen, device=device).tolist()
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(2, 24 * 44 + 1, BLOCK, 8, 128, device=device, generator=gen).to(dtype)
        tables = torch.randperm(24 * 44, generator=gen, device=device).view(24, 44) + 1
        meta = AttentionMetadata(
            torch.zeros(24, dtype=torch.long, device=device),
            torch.arange(25, device=device),
            torch.tensor(lens, device=device),
            tables,
            BLOCK,
            24,
            max(lens),
            list(range(25)),
            lens,
        )
        q = torch.randn(24, 32, 128, device=device, generator=gen).to(dtype)
        ref = _decode_attention(q.double(), kv.double(), meta, 128**-0.5)
        got = triton_attention.paged_decode_attention(q, kv, tables, meta.seq_lens, 128**-0.5)
        out[f"attention_{str(dtype)[6:]}"] = rel_err(got, ref)
    x = torch.randn(64, 4096, device=device, generator=gen).to(torch.bfloat16)
    res = torch.randn(64, 4096, device=device, generator=gen).to(torch.bfloat16)
    w = (1 + 0.1 * torch.randn(4096, device=device, generator=gen)).to(torch.bfloat16)
    out["rms_norm_bf16"] = rel_err(
        ops.rms_norm(x, w, 1e-5), TORCH_LAYER_OPS.rms_norm(x.double(), w.double(), 1e-5)
    )
    res_ref = res.double() + x.double()
    out["add_rms_norm_bf16"] = rel_err(
        ops.add_rms_norm(x, res, w, 1e-5), TORCH_LAYER_OPS.rms_norm(res_ref, w.double(), 1e-5)
    )
    from common.torch.models.llama import RotaryEmbedding

    table = RotaryEmbedding(128, 8192, 500000.0, None).cos_sin.to(device)
    positions = torch.randint(0, 8192, (64,), generator=gen, device=device)
    qkv = torch.randn(64, 48, 128, device=device, generator=gen).to(torch.bfloat16)
    ref = TORCH_LAYER_OPS.rotary(
        qkv.double(), 40, TORCH_LAYER_OPS.rope_for_step(table.double(), positions, torch.float64)
    )
    out["rotary_bf16"] = rel_err(
        ops.rotary(qkv, 40, ops.rope_for_step(table, positions, None)), ref
    )
    gu = torch.randn(64, 2 * 14336, device=device, generator=gen).to(torch.bfloat16)
    out["silu_and_mul_bf16"] = rel_err(
        ops.silu_and_mul(gu), TORCH_LAYER_OPS.silu_and_mul(gu.double())
    )
    return out


def graph_time_us(fn, calls: int = 10) -> float:
    """Microseconds per call of ``fn`` replayed from a CUDA graph of ``calls`` calls (no
    launch overhead in the figure)."""
    fn(), fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return event_median_ms(graph.replay, iters=10) * 1e3 / calls


def time_us(fn, device: torch.device) -> float:
    """Microseconds per call of ``fn``: CUDA-graph replays on CUDA, host time on the CPU (the
    smoke runs under Triton's interpreter)."""
    if device.type != "cuda":
        return event_median_ms(fn, iters=2, warmup=1) * 1e3
    return graph_time_us(fn)


def attention_shape(device: torch.device) -> tuple[int, int, int, torch.dtype]:
    """(query heads, KV heads, head size, dtype) the attention benchmarks use: Llama-3-8B's in
    bf16 on CUDA, a small float32 one for the CPU smoke runs (Triton's interpreter)."""
    return (32, 8, 128, torch.bfloat16) if device.type == "cuda" else (4, 2, 32, torch.float32)


def decode_inputs(
    batch: int, context: int | list[int], device: torch.device
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """A decode step of ``batch`` requests at ``context`` tokens (one length or one per request;
    ``fabricated_meta``), a random cache covering their blocks and their queries, at
    ``attention_shape``."""
    heads, kv_heads, dim, dtype = attention_shape(device)
    meta = fabricated_meta(batch, context, device)
    blocks = sum(-(-n // BLOCK) for n in meta.seq_lens_host) + 1
    kv = torch.randn(2, blocks, BLOCK, kv_heads, dim, device=device).to(dtype)
    q = torch.randn(batch, heads, dim, device=device).to(dtype)
    return meta, kv, q


def sweep_attention(device: torch.device, full: bool) -> list[dict]:
    """The decode attention kernel alone, bf16, Llama-3-8B heads (32 query, 8 KV, 128 wide),
    at its own choice and one partition (``full``: every partition count and tile size);
    achieved KV bandwidth."""
    from executor_gpu.cuda import triton_attention as ta

    rows = []
    for batch, context in ((64, 256), (64, 1024), (16, 256), (1, 1024)):
        meta, kv, q = decode_inputs(batch, context, device)
        kv_bytes = 2 * batch * context * 8 * 128 * 2
        picked = ta.partitions_for(batch, 8, device)
        grid = (
            [(p, t) for p in (1, 2, 4, 8, 16) for t in (32, 64, 128)]
            if full
            else [(1, ta.TILE), (picked, ta.TILE)]
        )
        for parts, tile in dict.fromkeys(grid):
            us = graph_time_us(
                functools.partial(
                    ta.paged_decode_attention,
                    q,
                    kv,
                    meta.block_tables,
                    meta.seq_lens,
                    0.088,
                    parts=parts,
                    tile=tile,
                )
            )
            rows.append(
                {
                    "batch": batch,
                    "context": context,
                    "parts": parts,
                    "tile": tile,
                    "us": us,
                    "TBps": kv_bytes / us / 1e6,
                    "picked": parts == picked and tile == ta.TILE,
                }
            )
        del kv
    return rows
