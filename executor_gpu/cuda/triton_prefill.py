"""CUDA prefill attention over the paged KV cache, in Triton: every prefill chunk of a step in
one launch.

The query tokens of all prefilling requests are packed in the step's flat batch
(``query_start_loc``: cu_seqlens-style offsets); request r's chunk of ``q_len`` tokens is the
end of its context of ``seq_len`` tokens (the first ``seq_len - q_len`` were cached before the
step: a prefix-cache hit or earlier chunks). One program computes ``BLOCK_M`` query tokens of
one request for one query head: it walks the keys that tile can see (causal; within the window
of a sliding-window layer) ``BLOCK_N`` at a time, reading keys and values in place through the
request's block table, with an online softmax in float32 (in base 2: exp2). Key tiles that
end before the tile's first query need no causal mask and are walked first; on CUDA both walks
are counted loops, which the compiler software-pipelines. Programs whose tile lies past their
request's chunk return at once, so the grid is sized by the longest chunk of the step and any
mix of lengths shares it.

The new tokens' keys and values are in the cache before the launch (the backend writes them
first), so a chunk sees its own keys like the cached ones. A step whose only chunk is a fresh
prompt (no cached prefix) is the one case left to torch's fused attention (FlashAttention),
which is faster there (``prefill``). Without a cache (the profiling pass
before it exists; every request starts at position 0) the keys and values are read from the
step's packed ``key`` / ``value`` tensors instead.

Like the decode kernel (``triton_attention``): GQA (a query head reads its KV head's rows),
head sizes that are not a power of two (padded to a tile), ``window`` (sliding-window layers)
and ``softcap`` (scores capped before the mask), float32 / bfloat16 / float16 inputs; it runs
under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors for the tests.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources

from common.torch.attention import AttentionMetadata, plain_causal, whole_chunk_attention

#: Launch settings in order of preference, (BLOCK_M, BLOCK_N, num_warps, stages: the key loops'
#: software-pipelining depth), for rows of up to 256 bytes (16-bit heads up to 128 wide) and for
#: wider ones. The first narrow one was the fastest in ``gpu_step.py --tune`` on an H200
#: (1.05-1.16x over 128 x 64 tiles; 96 KiB of shared memory for 128-wide bf16 heads); a device
#: whose shared memory a setting exceeds gets the next (``launch_settings``).
NARROW_TILES = ((128, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4, 2))
WIDE_TILES = ((64, 32, 4, 3), (32, 32, 4, 2), (32, 16, 4, 1))
#: Programs ordered so that a chunk's last query tiles (the most keys under the causal mask)
#: are started first, and the short ones fill in behind them.
LONGEST_FIRST = True


@triton.jit
def _attend_tile(
    q,
    q_pos,
    m_i,
    l_i,
    acc,
    start,
    last_pos,
    k_ptr,
    v_ptr,
    table,
    q_start,
    head_off,
    kv_stride_block,
    kv_stride_slot,
    window,
    scale,
    softcap,
    BLOCK_N: tl.constexpr,
    DIM_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    WINDOW: tl.constexpr,
    DIAGONAL: tl.constexpr,
):
    """The online-softmax update of a query tile by the keys at ``start .. start + BLOCK_N``
    (those before ``last_pos``): returns the new (max, denominator, weighted sum), the max in
    base-2 units. Off the ``DIAGONAL`` every key of the tile precedes every query: no causal
    mask, no bound, and (for head sizes that are a power of two) unmasked loads."""
    k_pos = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, DIM_PAD)
    k_ok = k_pos < last_pos
    if PAGED:  # through the block table
        if DIAGONAL:
            block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
        else:
            block = tl.load(table + k_pos // BLOCK_SIZE)
        row = block.to(tl.int64) * kv_stride_block + (k_pos % BLOCK_SIZE) * kv_stride_slot
    else:  # the step's own packed keys (no cache: the context is the chunk)
        row = (q_start + k_pos).to(tl.int64) * kv_stride_slot
    offs = head_off + row[:, None] + d[None, :]
    if HEAD_DIM != DIM_PAD:
        kv_mask = k_ok[:, None] & (d < HEAD_DIM)[None, :]
        k = tl.load(k_ptr + offs, mask=kv_mask, other=0.0)  # [BLOCK_N, D]
        v = tl.load(v_ptr + offs, mask=kv_mask, other=0.0)
    elif DIAGONAL:
        k = tl.load(k_ptr + offs, mask=k_ok[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=k_ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    k, v = k.to(q.dtype), v.to(q.dtype)
    qk = tl.dot(q, tl.trans(k), input_precision=PRECISION)  # [M, N]
    if SOFTCAP:  # cap * tanh(s / cap), tanh written with a sigmoid; then in base 2
        qk = softcap * (2.0 * tl.sigmoid(2.0 * (qk * scale) / softcap) - 1.0)
        qk = qk * 1.4426950408889634
        qk_scale = 1.0
    else:  # the scale and log2(e) in one multiply, fused with the max's subtraction below
        qk_scale = scale * 1.4426950408889634
    if DIAGONAL:
        visible = k_ok[None, :] & (k_pos[None, :] <= q_pos[:, None])
        if WINDOW:
            visible = visible & (k_pos[None, :] > q_pos[:, None] - window)
        qk = tl.where(visible, qk, float("-inf"))
    elif WINDOW:
        qk = tl.where(k_pos[None, :] > q_pos[:, None] - window, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    p = tl.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = tl.dot(p.to(q.dtype), v, acc * alpha[:, None], input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _paged_prefill_kernel(
    out_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    seq_lens_ptr,
    qsl_ptr,
    first_req,
    scale,
    window,
    softcap,
    q_stride_t,
    q_stride_h,
    out_stride_t,
    out_stride_h,
    kv_stride_block,
    kv_stride_slot,
    kv_stride_head,
    table_stride,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    PRECISION: tl.constexpr,
    PAGED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_F32: tl.constexpr,
    PIPELINED: tl.constexpr,
    WINDOW: tl.constexpr,
    LONGEST_FIRST: tl.constexpr,
):
    if LONGEST_FIRST:  # the last tiles of a chunk see the most keys: started first
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile = tl.program_id(0)
    req = first_req + tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(qsl_ptr + req)
    q_len = (tl.load(qsl_ptr + req + 1) - q_start).to(tl.int32)
    if tile * BLOCK_M >= q_len:  # past this request's chunk (the grid fits the longest one)
        return
    seq_len = tl.load(seq_lens_ptr + req).to(tl.int32)
    prefix = seq_len - q_len  # tokens cached before this step
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    q_mask = (m < q_len)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(
        q_ptr + (q_start + m)[:, None] * q_stride_t + head * q_stride_h + d[None, :],
        mask=q_mask,
        other=0.0,
    )
    if DOT_F32:  # (the interpreter's bfloat16 products: see paged_prefill_attention)
        q = q.to(tl.float32)
    # Keys this tile may see: up to its last query (causal), from its first query's window.
    last_pos = tl.minimum(prefix + (tile + 1) * BLOCK_M, seq_len)
    lo = tl.where(window > 0, tl.maximum(prefix + tile * BLOCK_M - window + 1, 0), 0)
    # The running max starts finite: a row whose window begins past the first tile has
    # nothing visible there, and exp(-inf - -inf) would be NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running softmax denominator
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)  # running weighted sum of values
    table = tables_ptr + req * table_stride
    head_off = (head // GROUP) * kv_stride_head
    # Keys before the tile's first query are seen by all its rows (the causal mask is only
    # needed from there on, on the diagonal): whole key tiles up to there, then the rest.
    diagonal = lo + ((prefix + tile * BLOCK_M - lo) // BLOCK_N) * BLOCK_N
    if PIPELINED:  # counted loops, which the compiler software-pipelines (loads ahead)
        for start in tl.range(lo, diagonal, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, prefix + m, m_i, l_i, acc, start, last_pos, k_ptr, v_ptr, table, q_start,
                head_off, kv_stride_block, kv_stride_slot, window, scale, softcap,
                BLOCK_N, DIM_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION, PAGED, SOFTCAP, WINDOW, False,
            )  # fmt: skip
        for start in tl.range(diagonal, last_pos, BLOCK_N):
            m_i, l_i, acc = _attend_tile(
                q, prefix + m, m_i, l_i, acc, start, last_pos, k_ptr, v_ptr, table, q_start,
                head_off, kv_stride_block, kv_stride_slot, window, scale, softcap,
                BLOCK_N, DIM_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION, PAGED, SOFTCAP, WINDOW, True,
            )  # fmt: skip
    else:  # the same loops for Triton's interpreter, which cannot range over a tensor
        start = lo
        while start < diagonal:
            m_i, l_i, acc = _attend_tile(
                q, prefix + m, m_i, l_i, acc, start, last_pos, k_ptr, v_ptr, table, q_start,
                head_off, kv_stride_block, kv_stride_slot, window, scale, softcap,
                BLOCK_N, DIM_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION, PAGED, SOFTCAP, WINDOW, False,
            )  # fmt: skip
            start += BLOCK_N
        while start < last_pos:
            m_i, l_i, acc = _attend_tile(
                q, prefix + m, m_i, l_i, acc, start, last_pos, k_ptr, v_ptr, table, q_start,
                head_off, kv_stride_block, kv_stride_slot, window, scale, softcap,
                BLOCK_N, DIM_PAD, HEAD_DIM, BLOCK_SIZE, PRECISION, PAGED, SOFTCAP, WINDOW, True,
            )  # fmt: skip
            start += BLOCK_N
    # (Rows past the chunk may have seen nothing: l = 0 there, and they are not stored.)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + m)[:, None] * out_stride_t + head * out_stride_h + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=q_mask,
    )


#: (row elements, element size, device) -> the first setting of the table that compiled there
#: (recorded when an earlier one did not).
_FITTED: dict[tuple[int, int, torch.device], tuple[int, int, int, int]] = {}


def launch_settings(
    dim_pad: int, element_size: int, device: torch.device
) -> tuple[tuple[int, int, int, int], ...]:
    """The launch settings to try, in order, for rows of ``dim_pad`` elements on ``device``:
    NARROW_TILES / WIDE_TILES from the first one that compiled there before (a setting the
    compiler rejects for lack of shared memory is passed over for the next); small tiles under
    the interpreter, which pays per element, not per program."""
    if device.type != "cuda":
        return ((16, 16, 4, 1),)
    table = NARROW_TILES if dim_pad * element_size <= 256 else WIDE_TILES
    fitted = _FITTED.get((dim_pad, element_size, device))
    return table[table.index(fitted) :] if fitted in table else table


def paged_prefill_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor | None,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    first_req: int,
    num_reqs: int,
    max_query_len: int,
    out: torch.Tensor,
    key: torch.Tensor | None = None,
    value: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
    block_m: int = 0,
    block_n: int = 0,
    warps: int = 0,
    stages: int = 0,
    longest_first: bool = LONGEST_FIRST,
) -> torch.Tensor:
    """Causal attention of requests ``first_req .. first_req + num_reqs - 1`` of a packed step
    (query [T, heads, d], any strides with a unit last one) to their cached contexts, written
    into their rows of ``out`` ([T, heads, d]); returns ``out``.

    Request r's query tokens are rows ``query_start_loc[r] .. query_start_loc[r + 1]``; its
    context is ``seq_lens[r]`` tokens read through ``block_tables[r]`` from ``kv_cache``
    (common.torch.attention's layout, the chunk's own keys already stored).
    ``max_query_len`` bounds the chunks (the grid). With ``kv_cache=None``, every request
    starts at position 0 and its keys / values are the rows of ``key`` / ``value``
    ([T, kv_heads, d]) at its query rows. ``block_m`` / ``block_n`` / ``warps`` / ``stages``
    override ``launch_settings``' first choice, ``longest_first`` LONGEST_FIRST (the
    benchmark's comparisons).
    """
    num_heads, head_dim = query.shape[1], query.shape[2]
    if num_reqs == 0 or max_query_len == 0:
        return out
    assert query.stride(2) == 1 and out.stride(2) == 1
    paged = kv_cache is not None
    if paged:
        assert kv_cache.is_contiguous()
        k_src, v_src = kv_cache[0], kv_cache[1]
        kv_heads = kv_cache.shape[3]
        strides = (kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3))
        element_size = kv_cache.element_size()
    else:
        assert key is not None and value is not None
        if key.stride() != value.stride() or key.stride(2) != 1:  # (one offset serves both)
            key, value = key.contiguous(), value.contiguous()
        k_src, v_src = key, value
        kv_heads = key.shape[1]
        strides = (0, key.stride(0), key.stride(1))
        element_size = key.element_size()
    tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    dim_pad = max(16, triton.next_power_of_2(head_dim))
    settings = launch_settings(dim_pad, element_size, query.device)
    if block_m or block_n or warps or stages:  # one setting, as given
        m, n, w, st = settings[0]
        settings = ((block_m or m, block_n or n, warps or w, stages or st),)
    # Triton's interpreter multiplies bfloat16 matrices wrongly (numpy has no bfloat16): there
    # the operands, rounded to bfloat16 all the same, are multiplied in float32.
    dot_f32 = query.device.type != "cuda" and query.dtype == torch.bfloat16
    for i, (tile_m, tile_n, num_warps, num_stages) in enumerate(settings):
        try:
            _paged_prefill_kernel[(triton.cdiv(max_query_len, tile_m), num_reqs, num_heads)](
                out, query, k_src, v_src, tables, seq_lens, query_start_loc, first_req, scale,
                window, softcap, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
                *strides, tables.stride(0),
                GROUP=num_heads // kv_heads,
                HEAD_DIM=head_dim,
                DIM_PAD=dim_pad,
                BLOCK_M=tile_m,
                BLOCK_N=tile_n,
                BLOCK_SIZE=kv_cache.shape[2] if paged else 1,
                PRECISION="ieee" if query.dtype == torch.float32 or dot_f32 else "tf32",
                PAGED=paged,
                SOFTCAP=softcap > 0,
                DOT_F32=dot_f32,
                PIPELINED=query.device.type == "cuda",
                WINDOW=window > 0,
                LONGEST_FIRST=longest_first,
                num_warps=num_warps,
                num_stages=num_stages,
            )  # fmt: skip
        except OutOfResources:  # (raised when compiling, before anything runs)
            if i + 1 == len(settings):
                raise
            continue
        if i > 0:  # the next steps start from the setting that compiled
            _FITTED[(dim_pad, element_size, query.device)] = settings[i]
        break
    return out


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> None:
    """The step's prefill chunks (requests ``meta.num_decodes`` onwards) in one launch, into
    their rows of ``out``: the ``prefill`` of ``paged_attention_with``. A step whose only
    chunk is its request's whole context (a fresh prompt, no cached prefix) goes to torch's
    fused attention over the step's own keys instead (``whole_chunk_attention``): also one
    launch, and faster there (FlashAttention; benchmarks/README.md)."""
    first = meta.num_decodes if kv_cache is not None else 0
    qsl = meta.query_start_loc_host
    if meta.num_requests - first == 1:
        start, end = qsl[first], qsl[first + 1]
        if meta.seq_lens_host[first] == end - start and plain_causal(end - start, window, softcap):
            out[start:end] = whole_chunk_attention(
                query[start:end], key[start:end], value[start:end], scale
            )
            return
    longest_key = ("prefill_longest", first)
    if longest_key not in meta.derived:  # once per step, shared by the layers
        meta.derived[longest_key] = max(b - a for a, b in zip(qsl[first:-1], qsl[first + 1 :]))
    longest = meta.derived[longest_key]
    paged_prefill_attention(
        query,
        kv_cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        first,
        meta.num_requests - first,
        longest,
        out,
        key,
        value,
        window=window,
        softcap=softcap,
    )
