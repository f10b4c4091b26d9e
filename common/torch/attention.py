"""Paged attention: per-step metadata and the reference torch implementation.

KV-cache layout (one tensor per layer)::

    kv_cache[2, num_blocks, block_size, num_kv_heads, head_dim]
             ^ 0 = keys, 1 = values

Token slot ``s = block_id * block_size + offset`` addresses ``kv_cache[:, block_id, offset]``; a
request's block table lists its blocks in sequence order, so the token at position ``p`` lives
in block ``block_table[p // block_size]`` at offset ``p % block_size``.

A step is a flat ragged batch of T new tokens from R requests. The batch builder orders requests
so that those with a single query token (decodes, or a one-token prefill tail) come first: they
are attended together in one gathered, padded, masked pass. Longer query chunks (prefills) are
attended one request at a time with an explicit causal mask offset by the tokens already cached;
a device backend built with ``paged_attention_with`` may replace either part (the CUDA one
attends every prefill chunk in one kernel launch).

Every backend takes two per-layer options beside the scale: ``window`` (sliding-window
attention: a query at position p sees the keys at positions p - window + 1 .. p; 0 = the whole
context, as transformers' ``sliding_window``) and ``softcap`` (attention logit soft-capping,
``cap * tanh(score / cap)`` before the mask, Gemma 2; 0 = none).

Backends are plain functions registered by name; a device package can register a fused kernel
and select it with ``get_attention_backend``. Nothing here is device specific.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Where one step's tokens go in the paged KV cache and what each of them attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor  # [R+1] int64: first token of each request in the flat batch
    seq_lens: torch.Tensor  # [R] int64: context length of each request after this step
    block_tables: torch.Tensor  # [R, max_blocks] int64: block ids, zero-padded
    block_size: int  # tokens per KV block
    num_decodes: int  # requests 0..num_decodes-1 have exactly one query token
    max_decode_seq_len: int  # longest context among those single-token requests
    query_start_loc_host: list[int]  # host copy of query_start_loc (no device sync in loops)
    seq_lens_host: list[int]  # host copy of seq_lens
    derived: dict[Any, Any] = field(default_factory=dict)  # per-step tensors that backends
    # derive once and share across layers (masks, sliced block tables)

    @property
    def num_requests(self) -> int:
        """Requests in the step."""
        return len(self.seq_lens_host)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens that belong to single-token requests (they come first in the batch)."""
        return self.num_decodes


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store the new tokens' keys/values ([T, kv_heads, head_dim]) at their cache slots."""
    _, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    flat = _as_bytes(kv_cache).view(2, num_blocks * block_size, kv_heads, head_dim)
    flat[0].index_copy_(0, slot_mapping, _as_bytes(key.to(kv_cache.dtype)))
    flat[1].index_copy_(0, slot_mapping, _as_bytes(value.to(kv_cache.dtype)))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """An fp8 tensor as its bytes (copies and gathers are not implemented for fp8 on every
    device; bytes move the same), any other as itself."""
    return t.view(torch.uint8) if t.element_size() == 1 else t


def _gather_context(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Keys and values of the given blocks ([n_blocks] or [R, n_blocks] ids):
    [2, (R,) n_blocks * block_size, kv_heads, head_dim]."""
    _, _, block_size, kv_heads, head_dim = kv_cache.shape
    gathered = _as_bytes(kv_cache).index_select(1, block_ids.reshape(-1)).view(kv_cache.dtype)
    return gathered.view(
        2, *block_ids.shape[:-1], block_ids.shape[-1] * block_size, kv_heads, head_dim
    )


def visible_keys(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int) -> torch.Tensor:
    """Which keys each query sees (broadcast of key positions against query positions): the
    causal part, cut to the last ``window`` positions where a window is set."""
    visible = key_pos <= query_pos
    if window > 0:
        visible &= key_pos > query_pos - window
    return visible


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Scaled dot-product attention (q [B, H, n, d], keys / values [B, KVH, L, d], additive
    mask broadcastable to [B, H, n, L]); with ``softcap``, scores are capped before the mask
    (SDPA has no such option, so that case is computed step by step)."""
    if softcap <= 0:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
        )
    group = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1) if group > 1 else keys
    values = values.repeat_interleave(group, dim=1) if group > 1 else values
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap + mask.float()
    return torch.matmul(scores.softmax(dim=-1), values.float()).to(q.dtype)


def _decode_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of single-token requests, batched: query [N, heads, d] -> [N, heads, d]."""
    n, num_heads, head_dim = query.shape
    kv_heads = kv_cache.shape[3]
    group = num_heads // kv_heads
    # Attention runs in the cache's dtype, except that an fp8 cache (no arithmetic of its own)
    # is widened to the query's on read.
    compute = query.dtype if kv_cache.element_size() == 1 else kv_cache.dtype
    key = ("decode", compute, window)
    if key not in meta.derived:
        bs = meta.block_size
        num_ctx_blocks = (meta.max_decode_seq_len + bs - 1) // bs
        length = num_ctx_blocks * bs
        span = torch.arange(length, device=query.device)[None, :]
        valid = visible_keys(span, meta.seq_lens[:n, None] - 1, window)
        mask = torch.zeros(n, 1, 1, length, dtype=compute, device=query.device)
        mask.masked_fill_(~valid[:, None, None, :], float("-inf"))
        meta.derived[key] = (mask, meta.block_tables[:n, :num_ctx_blocks])
    mask, tables = meta.derived[key]  # additive mask [N, 1, 1, L], block ids [N, L / bs]
    ctx = _gather_context(kv_cache, tables)  # [2, N, L, kvh, d]
    keys = ctx[0].transpose(1, 2).to(compute)  # [N, kvh, L, d]
    values = ctx[1].transpose(1, 2).to(compute)
    # The group of query heads sharing a KV head plays the role of the query-length axis, so the
    # keys are never repeated per head. Slots past a request's length (or before its window)
    # are masked out; they must hold finite values (a zero weight times NaN is NaN): the model
    # runner zeroes the slots of any request whose step produced non-finite values.
    q = query.view(n, kv_heads, group, head_dim).to(compute)
    out = attend(q, keys, values, mask, scale, softcap)
    return out.reshape(n, num_heads, head_dim).to(query.dtype)


def plain_causal(num_tokens: int, window: int, softcap: float) -> bool:
    """Whether a chunk of ``num_tokens`` that is its whole context needs only the causal mask
    (no soft-cap; no window, or one that covers the chunk)."""
    return softcap <= 0 and (window <= 0 or window >= num_tokens)


def whole_chunk_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float
) -> torch.Tensor:
    """Causal attention of a chunk ([n, heads, d]) that is its request's whole context, over
    its own keys and values ([n, kv_heads, d]): torch's fused attention (FlashAttention on
    CUDA), no cache read, no mask built. Returns [n, heads, d]."""
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    keys = key.transpose(0, 1).unsqueeze(0).to(q.dtype)
    values = value.transpose(0, 1).unsqueeze(0).to(q.dtype)
    out = F.scaled_dot_product_attention(
        q, keys, values, is_causal=True, scale=scale, enable_gqa=True
    )
    return out[0].transpose(0, 1)


def _prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: AttentionMetadata,
    req: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of one request's query chunk ([n, heads, d]) to its whole context."""
    n, num_heads, head_dim = query.shape
    seq_len = meta.seq_lens_host[req]
    num_cached = seq_len - n
    q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, n, d]
    if kv_cache is None or num_cached == 0:
        # The context is exactly the new tokens: no need to read the cache back, nor (where
        # neither a window nor a soft-cap applies) to build a mask.
        if plain_causal(n, window, softcap):
            return whole_chunk_attention(query, key, value, scale)
        keys = key.transpose(0, 1).unsqueeze(0).to(q.dtype)
        values = value.transpose(0, 1).unsqueeze(0).to(q.dtype)
    else:
        bs = meta.block_size
        num_ctx_blocks = (seq_len + bs - 1) // bs
        ctx = _gather_context(kv_cache, meta.block_tables[req, :num_ctx_blocks])
        keys = ctx[0, :seq_len].transpose(0, 1).unsqueeze(0).to(q.dtype)  # [1, kvh, L, d]
        values = ctx[1, :seq_len].transpose(0, 1).unsqueeze(0).to(q.dtype)
    mask_key = ("prefill", req, q.dtype, window)
    if mask_key not in meta.derived:  # built once per step, shared by the layers
        # Query i sits at position num_cached + i and sees keys 0..num_cached + i (the last
        # ``window`` of them with a window).
        query_pos = torch.arange(num_cached, seq_len, device=q.device)[:, None]
        visible = visible_keys(torch.arange(seq_len, device=q.device)[None, :], query_pos, window)
        mask = torch.zeros((n, seq_len), dtype=q.dtype, device=q.device)
        meta.derived[mask_key] = mask.masked_fill_(~visible, float("-inf"))
    out = attend(q, keys, values, meta.derived[mask_key], scale, softcap)
    return out[0].transpose(0, 1)  # [n, heads, d]


DecodeAttention = Callable[..., torch.Tensor]
#: (query, key, value, kv_cache, meta, scale, out, window=, softcap=) -> None: the attention of
#: every request from ``meta.num_decodes`` on (all of them with ``kv_cache=None``) written into
#: their rows of ``out``, in one call.
PrefillAttention = Callable[..., None]


def _torch_prefills(
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
    """The reference ``PrefillAttention``: one request at a time (``_prefill_attention``)."""
    qsl = meta.query_start_loc_host
    first = meta.num_decodes if kv_cache is not None else 0
    for req in range(first, meta.num_requests):
        start, end = qsl[req], qsl[req + 1]
        out[start:end] = _prefill_attention(
            query[start:end],
            key[start:end],
            value[start:end],
            kv_cache,
            meta,
            req,
            scale,
            window,
            softcap,
        )


def paged_attention_with(decode: DecodeAttention, prefill: PrefillAttention = _torch_prefills):
    """A paged-attention backend whose single-token requests go to `decode` (query [N, heads,
    d], the KV cache, the metadata and the scale, with the ``window`` and ``softcap`` keywords
    -> [N, heads, d]) and whose longer query chunks go to `prefill` (a ``PrefillAttention``;
    by default the torch implementation, one request at a time), after every new token's key
    and value is in the cache.

    A `decode` with a true ``stores_kv`` attribute also takes the decodes' new ``key`` and
    ``value`` ([N, kv_heads, d]) and stores them itself; the backend then writes only the
    other tokens' keys and values.
    """
    stores_kv = getattr(decode, "stores_kv", False)

    def backend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor:
        num_decodes = meta.num_decodes if kv_cache is not None else 0
        if kv_cache is not None:
            first_written = num_decodes if stores_kv else 0
            if first_written < key.shape[0]:
                write_kv(
                    kv_cache,
                    key[first_written:],
                    value[first_written:],
                    meta.slot_mapping[first_written:],
                )
        extra: dict[str, Any] = {"window": window, "softcap": softcap}
        if stores_kv and num_decodes:
            extra.update(key=key[:num_decodes], value=value[:num_decodes])
        if kv_cache is not None and num_decodes == meta.num_requests:
            return decode(query, kv_cache, meta, scale, **extra)
        out = torch.empty_like(query)
        if num_decodes > 0:
            out[:num_decodes] = decode(query[:num_decodes], kv_cache, meta, scale, **extra)
        prefill(query, key, value, kv_cache, meta, scale, out, window=window, softcap=softcap)
        return out

    return backend


#: Reference paged attention over a ragged batch: query [T, heads, d], key/value [T, kv_heads,
#: d] for the step's new tokens. The new keys and values are first written to ``kv_cache``
#: through ``meta.slot_mapping``; each query then attends causally to its own request's cached
#: context (its last ``window`` positions with a window). With ``kv_cache=None`` (profiling
#: before the cache exists) nothing is written and every request must start at position 0.
#: Returns [T, heads, d].
torch_paged_attention = paged_attention_with(_decode_attention)


#: (query, key, value, kv_cache, meta, scale, window=0, softcap=0.0) -> [T, heads, d].
AttentionBackend = Callable[..., torch.Tensor]

_BACKENDS: dict[str, AttentionBackend] = {"torch": torch_paged_attention}


def register_attention_backend(name: str, backend: AttentionBackend) -> None:
    """Make ``backend`` selectable under ``name`` (e.g. a fused CUDA kernel)."""
    _BACKENDS[name] = backend


def get_attention_backend(name: str = "torch") -> AttentionBackend:
    """The attention implementation registered under ``name``."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; have {sorted(_BACKENDS)}") from None
