"""CUDA decode attention over the paged KV cache, in Triton ("triton_paged").

One program computes one request's attention for one KV head: the group of query heads that
share that KV head (GQA) walks the request's context in tiles of ``TILE`` tokens, reading keys
and values in place through the block table (no gathered copy, no padded mask), with an online
softmax in float32. The group's queries are the rows of two small matrix products per tile
(padded to 16 rows for the tensor cores; float32 models multiply in full float32, "ieee").
The program's loop bound is the request's length read on the device, so one launch serves any
mix of lengths and the launch can be captured in a CUDA graph.

A sliding-window layer's programs start at the first position in the window (the tiles before
it are never read); soft-capped scores (``cap * tanh(score / cap)``) are capped before the
softmax. Longer query chunks (prefills) go to the prefill kernel (``triton_prefill``: every
chunk of the step in one launch); "triton_paged_torch_prefill" keeps the torch implementation
for them (one request at a time), for comparison. The kernel also runs under Triton's
interpreter (``TRITON_INTERPRET=1``) on CPU tensors, which is how the tests check it on machines
without a GPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.torch.attention import (
    AttentionMetadata,
    paged_attention_with,
    register_attention_backend,
)
from executor_gpu.cuda import triton_prefill

BACKEND_NAME = "triton_paged"
#: The same decodes with the torch prefills (the path before the prefill kernel).
TORCH_PREFILL_BACKEND_NAME = "triton_paged_torch_prefill"
#: Context tokens one loop iteration reads (a power of two, at least 16; the block size need not
#: divide it).
#: 128 measured fastest on an H200 (bf16, 128-wide heads): 2.9 TB/s of KV at batch 64 x 256
#: tokens against 2.1 for 64 (benchmarks/gpu_step.py --sweep). Wider rows get shorter tiles
#: (``tile_for``): a tile of keys is at most TILE_BYTES, which keeps a float32 model with
#: 256-wide heads within Hopper's shared memory.
TILE = 128
TILE_BYTES = 32 * 1024
#: Partitions split a context only when (requests x KV heads) programs would leave most
#: multiprocessors idle: at batch 64 a single partition was fastest (the combine pass costs more
#: than the parallelism gains); at batch 1 x 1024 tokens 8 partitions ran 3.3x faster than one.
MAX_PARTS = 8
#: num_warps of the main kernel (4 and 8 measured on an H200: 4 fastest or level everywhere).
WARPS = 4


@triton.jit
def _paged_decode_kernel(
    out_ptr,
    q_ptr,
    cache_ptr,
    tables_ptr,
    seq_lens_ptr,
    scale,
    window,
    softcap,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    kv_stride_side,
    kv_stride_block,
    kv_stride_slot,
    kv_stride_head,
    table_stride,
    k_new_ptr,
    v_new_ptr,
    slots_ptr,
    kn_stride_t,
    kn_stride_h,
    vn_stride_t,
    vn_stride_h,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    num_heads,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_TOKENS: tl.constexpr,
    PRECISION: tl.constexpr,
    STORE_KV: tl.constexpr,
    PARTS: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    # A request's KV heads are neighbours in launch order: together they read whole token
    # rows of the cache (every KV head of a token is stored side by side).
    kv_head = tl.program_id(0)
    req = tl.program_id(1)
    part = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    t = tl.arange(0, TILE_TOKENS)
    g_ok = g < GROUP
    d_ok = d < HEAD_DIM
    heads = kv_head * GROUP + g
    # The positions attended: the last `window` ones (window 0: all of them).
    first = tl.where(window > 0, tl.maximum(seq_len - window, 0), 0)
    # This program's share of them: whole tiles, the same count for every partition.
    tiles = (seq_len - first + TILE_TOKENS - 1) // TILE_TOKENS
    start = first + ((tiles + PARTS - 1) // PARTS) * TILE_TOKENS * part
    end = tl.minimum(start + ((tiles + PARTS - 1) // PARTS) * TILE_TOKENS, seq_len)
    if STORE_KV:  # the new key and value go to their slot first, by the program that reads it
        if (seq_len - 1 >= start) & (seq_len - 1 < end):
            new_slot = tl.load(slots_ptr + req)
            dst = cache_ptr + new_slot * kv_stride_slot + kv_head * kv_stride_head + d
            k_new = tl.load(k_new_ptr + req * kn_stride_t + kv_head * kn_stride_h + d, mask=d_ok)
            v_new = tl.load(v_new_ptr + req * vn_stride_t + kv_head * vn_stride_h + d, mask=d_ok)
            tl.store(dst, k_new.to(cache_ptr.dtype.element_ty), mask=d_ok)
            tl.store(dst + kv_stride_side, v_new.to(cache_ptr.dtype.element_ty), mask=d_ok)
            tl.debug_barrier()  # the program's threads read the slot back below
    # The group's queries as the rows of a matrix product (rows past the group are zero).
    q = tl.load(
        q_ptr + req * q_stride_t + heads[:, None] * q_stride_h + d[None, :],
        mask=g_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)  # running max per query head
    l_i = tl.zeros([GROUP_PAD], tl.float32)  # running softmax denominator
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)  # running weighted sum of values
    table = tables_ptr + req * table_stride
    head_base = cache_ptr + kv_head * kv_stride_head
    while start < end:  # (a while loop: Triton's interpreter cannot range over a tensor)
        pos = start + t
        ok = pos < end
        block = tl.load(table + pos // BLOCK_SIZE, mask=ok, other=0)
        slot = block.to(tl.int64) * kv_stride_block + (pos % BLOCK_SIZE) * kv_stride_slot
        offs = slot[:, None] + d[None, :]
        kv_mask = ok[:, None] & d_ok[None, :]
        k = tl.load(head_base + offs, mask=kv_mask, other=0.0)  # [TILE, D]
        v = tl.load(head_base + kv_stride_side + offs, mask=kv_mask, other=0.0)
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [GROUP, TILE]
        if SOFTCAP:  # cap * tanh(s / cap), tanh written with a sigmoid
            scores = softcap * (2.0 * tl.sigmoid(2.0 * scores / softcap) - 1.0)
        scores = tl.where(ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
        start += TILE_TOKENS
    mask = g_ok[:, None] & d_ok[None, :]
    if PARTS == 1:
        out = acc / l_i[:, None]
        tl.store(
            out_ptr + req * out_stride_t + heads[:, None] * out_stride_h + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=mask,
        )
    else:  # unnormalized partials; an empty partition leaves m = -inf, l = 0, acc = 0
        row = (req * num_heads + heads) * PARTS + part
        tl.store(part_m_ptr + row, m_i, mask=g_ok)
        tl.store(part_l_ptr + row, l_i, mask=g_ok)
        tl.store(part_acc_ptr + row[:, None] * DIM_PAD + d[None, :], acc, mask=mask)


@triton.jit
def _combine_parts_kernel(
    out_ptr,
    part_m_ptr,
    part_l_ptr,
    part_acc_ptr,
    out_stride_t,
    out_stride_h,
    num_heads,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    PARTS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    r = (req * num_heads + head) * PARTS + tl.arange(0, PARTS)
    d = tl.arange(0, DIM_PAD)
    m = tl.load(part_m_ptr + r)
    weight = tl.exp(m - tl.max(m, axis=0))  # 0 for empty partitions
    total = tl.sum(weight * tl.load(part_l_ptr + r), axis=0)
    acc = tl.load(part_acc_ptr + r[:, None] * DIM_PAD + d[None, :])
    out = tl.sum(weight[:, None] * acc, axis=0) / total
    tl.store(
        out_ptr + req * out_stride_t + head * out_stride_h + d,
        out.to(out_ptr.dtype.element_ty),
        mask=d < HEAD_DIM,
    )


def padded_dim(head_dim: int) -> int:
    """A head's width as the kernels lay it out: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(head_dim))


def tile_for(dim_pad: int, element_size: int) -> int:
    """Context tokens per loop iteration for rows of ``dim_pad`` elements."""
    return min(TILE, max(16, TILE_BYTES // (dim_pad * element_size)))


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (Triton's interpreter on the CPU: an H200's count)
    return torch.cuda.get_device_properties(device).multi_processor_count


def partitions_for(num_requests: int, kv_heads: int, device: torch.device) -> int:
    """Context partitions per (request, KV head): the fewest (a power of two up to MAX_PARTS)
    giving a program for every other multiprocessor. Fixed by the batch shape, so the choice is
    the same inside a captured graph."""
    want = _multiprocessors(device) // 2
    parts = 1
    while num_requests * kv_heads * parts < want and parts < MAX_PARTS:
        parts *= 2
    return parts


def paged_decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    slots: torch.Tensor | None = None,
    parts: int = 0,
    tile: int = 0,
    window: int = 0,
    softcap: float = 0.0,
    warps: int = WARPS,
) -> torch.Tensor:
    """Attention of N single-token queries ([N, heads, d], any strides with a unit last one) to
    their cached contexts; returns [N, heads, d] in the query's dtype.

    ``kv_cache`` is common.torch.attention's layout [2, blocks, block_size, kv_heads, d]; request i
    reads ``seq_lens[i]`` tokens through ``block_tables[i]``. Every length must be at least 1.
    With ``key`` / ``value`` ([N, kv_heads, d]) and ``slots`` ([N]) given, each request's new
    key and value are stored at its slot first (one launch instead of a separate cache write).
    ``parts`` (a power of two; 0 = ``partitions_for``) splits each context across programs
    whose partial softmax sums a second kernel combines; ``tile`` overrides TILE. ``window``
    (tokens; 0 = none) attends only to each request's last ``window`` positions; ``softcap``
    (0 = none) caps the scores. ``warps`` is the main kernel's num_warps.
    """
    n, num_heads, head_dim = query.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = num_heads // kv_heads
    out = torch.empty(n, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if n == 0:
        return out
    assert query.stride(2) == 1 and kv_cache.is_contiguous()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    store = key is not None
    if store:
        assert value is not None and slots is not None
        assert key.stride(2) == 1 and value.stride(2) == 1
    k_new, v_new = (key, value) if store else (query, query)
    parts = parts or partitions_for(n, kv_heads, query.device)
    dim_pad = padded_dim(head_dim)
    if parts > 1:
        part_m = torch.empty(n * num_heads * parts, dtype=torch.float32, device=query.device)
        part_l = torch.empty_like(part_m)
        part_acc = torch.empty(
            n * num_heads * parts, dim_pad, dtype=torch.float32, device=query.device
        )
    else:
        part_m = part_l = part_acc = out  # (unused)
    _paged_decode_kernel[(kv_heads, n, parts)](
        out,
        query,
        kv_cache,
        tables,
        seq_lens,
        scale,
        window,
        softcap,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.stride(2),
        kv_cache.stride(3),
        tables.stride(0),
        k_new,
        v_new,
        slots if store else seq_lens,
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        part_m,
        part_l,
        part_acc,
        num_heads,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        DIM_PAD=dim_pad,
        BLOCK_SIZE=block_size,
        TILE_TOKENS=tile or tile_for(dim_pad, kv_cache.element_size()),
        PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        STORE_KV=store,
        PARTS=parts,
        SOFTCAP=softcap > 0,
        num_warps=warps,
    )
    if parts > 1:
        _combine_parts_kernel[(n, num_heads)](
            out,
            part_m,
            part_l,
            part_acc,
            out.stride(0),
            out.stride(1),
            num_heads,
            HEAD_DIM=head_dim,
            DIM_PAD=dim_pad,
            PARTS=parts,
            num_warps=4,
        )
    return out


def _decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    n = query.shape[0]
    return paged_decode_attention(
        query,
        kv_cache,
        meta.block_tables[:n],
        meta.seq_lens[:n],
        scale,
        key,
        value,
        meta.slot_mapping[:n],
        window=window,
        softcap=softcap,
    )


_decode.stores_kv = True  # paged_attention_with leaves the decodes' cache writes to it


def register() -> None:
    """Register the "triton_paged" backend (Triton decodes and prefills) and
    "triton_paged_torch_prefill" (Triton decodes, torch prefills)."""
    register_attention_backend(BACKEND_NAME, paged_attention_with(_decode, triton_prefill.prefill))
    register_attention_backend(TORCH_PREFILL_BACKEND_NAME, paged_attention_with(_decode))
