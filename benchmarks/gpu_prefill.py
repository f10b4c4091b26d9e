"""Prefill on the CUDA executor: the batched Triton prefill kernel against the torch path it
replaces (one request at a time over a gathered, padded context), in one run.

Three step shapes of about 2048 new tokens (``CASES``): one fresh 2048-token prompt; two
1024-token chunks after 1024 cached tokens each (chunked prefill, prefix-cache hits); eight
256-token chunks after 256 cached tokens beside 32 decodes (a mixed step). For each, both
backends time the attention alone (Llama-3-8B heads: 32 query, 8 KV, 128 wide) and the whole
forward pass of the served model; throughput is reported in TFLOPS and as a fraction of the
device's dense bf16 peak (``bf16_peak``). Used by benchmarks/gpu_step.py.
"""

from __future__ import annotations

import os
from functools import partial

import torch

from benchmarks.gpu_kernels import BLOCK, attention_shape, event_median_ms, rel_err
from common.torch.attention import AttentionMetadata, get_attention_backend, visible_keys

#: Dense bf16 tensor-core peaks (TFLOPS, without sparsity), by a substring of the device name.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0}

#: name -> ([(cached, new)] of the prefilling requests, decodes, decode context).
CASES = {
    "fresh_1x2048": ([(0, 2048)], 0, 0),
    "chunks_2x1024_after_1024": ([(1024, 1024)] * 2, 0, 0),
    "mixed_8x256_after_256_plus_32_decodes": ([(256, 256)] * 8, 32, 512),
}
#: The same shapes at a size for the CPU smoke run (tiny model, Triton's interpreter).
SMOKE_CASES = {
    "fresh_1x32": ([(0, 32)], 0, 0),
    "chunks_2x16_after_16": ([(16, 16)] * 2, 0, 0),
    "mixed_2x8_after_8_plus_2_decodes": ([(8, 8)] * 2, 2, 16),
}


def bf16_peak(device: torch.device) -> float | None:
    """The device's dense bf16 peak in FLOP/s, where the name is known."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, tflops in PEAK_BF16_TFLOPS.items():
        if key in name:
            return tflops * 1e12
    return None


def step_meta(case: tuple, device: torch.device) -> AttentionMetadata:
    """A step of ``case``: its decodes first, then its prefill chunks, each request on its own
    consecutive blocks (from block 1)."""
    chunks, decodes, decode_ctx = case
    reqs = [(decode_ctx - 1, 1)] * decodes + list(chunks)
    per = max(-(-(c + n) // BLOCK) for c, n in reqs)
    tables = torch.arange(len(reqs) * per, device=device).view(len(reqs), per) + 1
    qsl, slots = [0], []
    for i, (cached, new) in enumerate(reqs):
        qsl.append(qsl[-1] + new)
        pos = torch.arange(cached, cached + new, device=device)
        slots.append(tables[i, pos // BLOCK] * BLOCK + pos % BLOCK)
    seq_lens = [c + n for c, n in reqs]
    return AttentionMetadata(
        slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, device=device),
        seq_lens=torch.tensor(seq_lens, device=device),
        block_tables=tables,
        block_size=BLOCK,
        num_decodes=decodes,
        max_decode_seq_len=decode_ctx if decodes else 0,
        query_start_loc_host=qsl,
        seq_lens_host=seq_lens,
    )


def attention_flops(case: tuple, heads: int, head_dim: int) -> float:
    """FLOPs of one layer's attention in the step: 4 * d per visible (query, key) pair and
    query head (the two products)."""
    chunks, decodes, decode_ctx = case
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in chunks) + decodes * decode_ctx
    return 4.0 * heads * head_dim * pairs


def _rates(flops: float, ms: float, peak: float | None) -> dict:
    tflops = flops / (ms / 1e3) / 1e12
    return {"ms": ms, "TFLOPS": tflops, "of_peak": tflops * 1e12 / peak if peak else None}


def prefill_inputs(case: tuple, device: torch.device) -> tuple:
    """A step of ``case`` (``step_meta``), a random cache covering its blocks and its
    queries, keys and values, at ``attention_shape``: (meta, cache, q, k, v)."""
    heads, kv_heads, dim, dtype = attention_shape(device)
    meta = step_meta(case, device)
    t = meta.query_start_loc_host[-1]
    blocks = int(meta.block_tables.max()) + 1
    cache = torch.randn(2, blocks, BLOCK, kv_heads, dim, device=device).to(dtype)
    q, k, v = (torch.randn(t, h, dim, device=device).to(dtype) for h in (heads, kv_heads, kv_heads))
    return meta, cache, q, k, v


def prefill_span(meta: AttentionMetadata) -> tuple[int, int, int]:
    """(first prefilling request, how many, the longest chunk): the step's arguments of
    ``triton_prefill.paged_prefill_attention``."""
    first, qsl = meta.num_decodes, meta.query_start_loc_host
    longest = max(b - a for a, b in zip(qsl[first:-1], qsl[first + 1 :]))
    return first, meta.num_requests - first, longest


def time_attention(device: torch.device, backends: dict[str, str], cases: dict) -> list[dict]:
    """One layer's attention of each case (the new tokens' cache writes included) per backend,
    at ``attention_shape``."""
    heads, _, dim, _ = attention_shape(device)
    peak = bf16_peak(device)
    rows = []
    for name, case in cases.items():
        meta, cache, q, k, v = prefill_inputs(case, device)
        flops = attention_flops(case, heads, dim)
        row: dict = {"case": name, "tokens": q.shape[0]}
        for variant, backend in backends.items():
            call = partial(get_attention_backend(backend), q, k, v, cache, meta, dim**-0.5)
            ms = event_median_ms(call, iters=10)
            row[variant] = _rates(flops, ms, peak)
        _speedup(row, backends)
        rows.append(row)
    return rows


def time_prefill_forward(runner, backends: dict[str, str], cases: dict) -> list[dict]:
    """The served model's forward pass (hidden states, no logits) over each case per
    backend; FLOPs = the layers' weight products plus attention."""
    model, device, g = runner.model, runner.device, runner.geometry
    layer_params = sum(p.numel() for p in model.model.layers.parameters())
    heads = next(m.num_heads for m in model.modules() if hasattr(m, "num_heads"))
    stack = getattr(model, "stack_forward", None)
    peak = bf16_peak(device)
    rows = []
    with torch.inference_mode():
        for name, case in cases.items():
            meta = step_meta(case, device)
            t = meta.query_start_loc_host[-1]
            ids = torch.randint(0, g.vocab_size, (t,), device=device)
            pos = torch.cat(
                [
                    torch.arange(s - (b - a), s, device=device)
                    for a, b, s in zip(
                        meta.query_start_loc_host, meta.query_start_loc_host[1:], meta.seq_lens_host
                    )
                ]
            )
            flops = 2.0 * t * layer_params
            flops += g.num_layers * attention_flops(case, heads, g.head_dim)
            row: dict = {"case": name, "tokens": t, "GFLOP": flops / 1e9}
            for variant, backend in backends.items():
                model.set_attention_backend(backend)
                # The CPU's one-call decoder stack has its own attention: not for another one.
                model.stack_forward = stack if backend == runner.attention_backend else None
                meta.derived.clear()
                ms = event_median_ms(partial(model, ids, pos, meta), iters=5, warmup=2)
                row[variant] = _rates(flops, ms, peak)
            _speedup(row, backends)
            rows.append(row)
    model.set_attention_backend(runner.attention_backend)
    model.stack_forward = stack
    return rows


def _speedup(row: dict, backends: dict[str, str]) -> None:
    if "old" in backends and "new" in backends:
        row["speedup"] = row["old"]["ms"] / row["new"]["ms"]


def check_prefill_kernel(device: torch.device) -> dict:
    """Relative error of the prefill kernel against a float64 reference on the GPU: a mixed
    step over shuffled blocks, bf16 and float32."""
    from executor_gpu.cuda import triton_prefill

    out = {}
    gen = torch.Generator(device=device).manual_seed(1)
    chunks = [(0, 300), (37, 200), (500, 129), (1000, 64)]
    meta = step_meta((chunks, 0, 0), device)
    perm = torch.randperm(int(meta.block_tables.max()), generator=gen, device=device) + 1
    meta.block_tables = perm[meta.block_tables - 1]
    for dtype in (torch.float32, torch.bfloat16):
        kv = torch.randn(2, perm.numel() + 1, BLOCK, 8, 128, device=device, generator=gen)
        q = torch.randn(meta.query_start_loc_host[-1], 32, 128, device=device, generator=gen)
        got = triton_prefill.paged_prefill_attention(
            q.to(dtype),
            kv.to(dtype),
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            128**-0.5,
            0,
            len(chunks),
            300,
            torch.empty_like(q.to(dtype)),
        )
        ref = _reference(q.to(dtype).double(), kv.to(dtype).double(), meta, 128**-0.5)
        out[f"prefill_{str(dtype)[6:]}"] = rel_err(got, ref)
    return out


def _reference(q, kv, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Every request's causal attention over its gathered context (float64)."""
    out = torch.empty_like(q)
    flat = kv.view(2, -1, kv.shape[3], kv.shape[4])
    qsl = meta.query_start_loc_host
    for r, seq_len in enumerate(meta.seq_lens_host):
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[r, pos // BLOCK] * BLOCK + pos % BLOCK
        keys = flat[0, slots].repeat_interleave(4, dim=1).transpose(0, 1)
        values = flat[1, slots].repeat_interleave(4, dim=1).transpose(0, 1)
        n = qsl[r + 1] - qsl[r]
        scores = q[qsl[r] : qsl[r + 1]].transpose(0, 1) @ keys.transpose(1, 2) * scale
        seen = visible_keys(pos[None, :], pos[seq_len - n :, None], 0)
        scores = scores.masked_fill(~seen, float("-inf"))
        out[qsl[r] : qsl[r + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def prefill_backends(runner) -> dict[str, str]:
    """The attention backends compared on prefill: on CUDA the Triton decodes with torch
    prefills ("old") and with the prefill kernel ("new"); on the CPU the runner's own ("old")
    and, under Triton's interpreter, the Triton backend ("new")."""
    from executor_gpu.cuda import triton_attention

    if runner.device.type == "cuda":
        if runner.attention_backend != triton_attention.BACKEND_NAME:
            return {"old": runner.attention_backend}
        return {
            "old": triton_attention.TORCH_PREFILL_BACKEND_NAME,
            "new": triton_attention.BACKEND_NAME,
        }
    if os.environ.get("TRITON_INTERPRET") != "1":
        return {"old": runner.attention_backend}
    triton_attention.register()
    return {"old": runner.attention_backend, "new": triton_attention.BACKEND_NAME}


def print_prefill(report: dict) -> None:
    """One line per prefill case and variant."""
    for key in ("prefill_attention", "prefill_forward"):
        for r in report.get(key) if isinstance(report.get(key), list) else []:
            for variant in ("old", "new"):
                if variant in r:
                    v = r[variant]
                    peak = f"{v['of_peak']:.3f}" if v["of_peak"] is not None else "-"
                    print(
                        f"{key} {r['case']:>40} {variant}: {v['ms']:8.3f} ms "
                        f"{v['TFLOPS']:8.2f} TFLOPS, {peak} of bf16 peak"
                    )


def summary(report: dict) -> dict:
    """The issue's figures: prefill's fraction of the bf16 peak per case (old path, new) and the
    largest batch's replayed decode step over its bytes at the copy rate."""
    out: dict = {}
    for key in ("prefill_attention", "prefill_forward"):
        for r in report.get(key) if isinstance(report.get(key), list) else []:
            for variant in ("old", "new"):
                if variant in r:
                    out[f"{key}/{r['case']}/{variant}_of_peak"] = r[variant]["of_peak"]
                    out[f"{key}/{r['case']}/{variant}_ms"] = r[variant]["ms"]
            out[f"{key}/{r['case']}/speedup"] = r.get("speedup")
    rows = [r for r in report.get("forward", []) if r["variant"] == "graph"]
    if rows:
        top = max(rows, key=lambda r: (r["batch"], -r["context"]))
        out[f"decode_b{top['batch']}_ctx{top['context']}_over_copy"] = top["over_copy"]
    return out
