"""Static-shape paged attention for XLA: the KV layout, cache writes, and two backends.

KV layout (one tensor per layer)::

    kv_cache[num_blocks, block_size, 2 * kv_heads_p, head_dim_p]
    heads interleaved: 2h = keys of head h, 2h + 1 = its values

which is the page layout of torch_xla's ragged paged attention kernel. For that kernel the
number of combined heads must tile (1, 2, 4, 8 or a multiple of 8, per 32-bit word) and the head
size is a multiple of 128, so the layout may carry zero padding (``kv_heads_p >= kv_heads``,
``head_dim_p >= head_dim``); the gather backend needs none.

Backends (registered in common.torch.attention, selected by the model runner):

- ``xla_ragged`` — the ragged paged attention Pallas kernel (TPU only).
- ``xla_gather`` — a reference for any XLA device (XLA:CPU in development and CI): every query
  token gathers its request's whole block table (fixed width) and masks the positions after its
  own (and, in a sliding-window layer, those before its window), so every shape is static.

Both take the layer's ``window`` and ``softcap`` (see common.torch.attention); each layer's
values are constants of the traced program, so a model mixing windowed and global layers
still compiles one program per shape.

Cache writes go through ``index_copy_`` at the tokens' slots; padding tokens all write slot 0 of
the reserved null block. Written values are made finite (``nan_to_num``), so a failed request
cannot leave a non-finite value that a later owner of its blocks would multiply by a zero
attention weight.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from common.torch.attention import register_attention_backend, visible_keys


@dataclass(frozen=True)
class KVLayout:
    """Head counts and sizes of the KV tensor, padded or not."""

    num_kv_heads: int  # the model's key/value heads
    head_dim: int  # the model's head size
    padded_kv_heads: int  # heads stored per block (>= num_kv_heads)
    padded_head_dim: int  # head size stored (>= head_dim)

    def shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """One layer's KV tensor shape."""
        return (num_blocks, block_size, 2 * self.padded_kv_heads, self.padded_head_dim)

    @property
    def padded(self) -> bool:
        """Whether the layout stores padding."""
        return (self.padded_kv_heads, self.padded_head_dim) != (self.num_kv_heads, self.head_dim)


def plain_layout(num_kv_heads: int, head_dim: int) -> KVLayout:
    """No padding (the gather backend)."""
    return KVLayout(num_kv_heads, head_dim, num_kv_heads, head_dim)


def kernel_layout(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> KVLayout:
    """Padding the ragged kernel needs: head size up to a multiple of 128, and kv heads up to a
    count whose combined (key + value) heads tile a 32-bit word row."""
    packing = max(1, 4 // dtype_bytes)

    def tiles(heads: int) -> bool:
        combined = 2 * heads
        if combined % packing:
            return False
        words = combined // packing
        return words in (1, 2, 4, 8) or words % 8 == 0

    heads = num_kv_heads
    while not tiles(heads):
        heads += 1
    return KVLayout(num_kv_heads, head_dim, heads, -(-head_dim // 128) * 128)


@dataclass
class StaticAttentionMetadata:
    """Per-step attention inputs of a padded step (all device tensors of fixed shapes)."""

    slot_mapping: torch.Tensor  # [T] int64 cache slot of each token
    positions: torch.Tensor  # [T] int64 position of each token
    token_rows: torch.Tensor  # [T] int64 row of each token (R for padding tokens)
    block_tables: torch.Tensor  # [R + 1, W] int32 block ids; row R is all null
    seq_lens: torch.Tensor  # [R] int32 context length after the step
    query_start_loc: torch.Tensor  # [R + 1] int32 first token of each row
    num_seqs: torch.Tensor  # [1] int32 real rows
    block_size: int  # tokens per block
    layout: KVLayout  # the KV tensor's layout
    mesh: Any = None  # the SPMD mesh (executor_tpu.spmd.SpmdMesh) when sharded, else None
    derived: dict[Any, Any] = field(default_factory=dict)  # per-step tensors shared by layers


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: StaticAttentionMetadata
) -> None:
    """Store the new tokens' keys/values ([T, kv_heads, head_dim]) at their slots."""
    layout = meta.layout
    if layout.padded:
        pad = (
            0,
            layout.padded_head_dim - layout.head_dim,
            0,
            layout.padded_kv_heads - layout.num_kv_heads,
        )
        key, value = F.pad(key, pad), F.pad(value, pad)
    t = key.shape[0]
    combined = torch.stack([key, value], dim=2).reshape(t, *kv_cache.shape[2:])
    # Only finite values enter the cache: attention gives masked slots a zero weight, and
    # zero times a non-finite value left by a failed request would still poison the sum.
    combined = torch.nan_to_num(combined.to(kv_cache.dtype))
    kv_cache.view(-1, *kv_cache.shape[2:]).index_copy_(0, meta.slot_mapping, combined)


#: Under SPMD, how the kernel's inputs are split: query heads, the KV cache's heads, the
#: per-step tables whole on every device; and its output, split over the query heads.
HEADS_SPEC = (None, "tp", None)
KERNEL_SPECS = (HEADS_SPEC, (None, None, "tp", None), (None,), (None, None), (None,), (None,))


def gather_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: StaticAttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal paged attention with static shapes: query [T, heads, d] -> [T, heads, d]."""
    if kv_cache is None:
        raise RuntimeError("static attention needs a bound KV cache")
    write_kv(kv_cache, key, value, meta)
    t, num_heads, head_dim = query.shape
    kv_heads = key.shape[1]
    group = num_heads // kv_heads
    if ("gather", window) not in meta.derived:
        tables = meta.block_tables.index_select(0, meta.token_rows)  # [T, W]
        length = tables.shape[1] * meta.block_size
        span = torch.arange(length, device=query.device)
        visible = visible_keys(span[None, :], meta.positions[:, None], window)
        meta.derived["gather", window] = (tables.reshape(-1), visible)
    flat_tables, visible = meta.derived["gather", window]  # [T * W], [T, L]
    length = visible.shape[1]
    ctx = kv_cache.index_select(0, flat_tables).view(t, length, *kv_cache.shape[2:])
    keys = ctx[:, :, 0 : 2 * kv_heads : 2, :head_dim]  # [T, L, kvh, d]
    values = ctx[:, :, 1 : 2 * kv_heads : 2, :head_dim]
    q = query.view(t, kv_heads, group, head_dim).float()
    scores = torch.einsum("tkgd,tlkd->tkgl", q, keys.float()) * scale
    if softcap > 0:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = scores.softmax(dim=-1)
    out = torch.einsum("tkgl,tlkd->tkgd", weights, values.float())
    return out.reshape(t, num_heads, head_dim).to(query.dtype)


def ragged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor | None,
    meta: StaticAttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """The same attention through torch_xla's ragged paged attention kernel (TPU only), which
    takes the window and the soft-cap itself."""
    from torch_xla.experimental.custom_kernel import ragged_paged_attention

    if kv_cache is None:
        raise RuntimeError("static attention needs a bound KV cache")
    write_kv(kv_cache, key, value, meta)
    t, num_heads, head_dim = query.shape
    layout = meta.layout
    group = num_heads // layout.num_kv_heads
    # Query heads follow their kv head (head h reads kv head h // group): padded kv heads get
    # zero query heads appended, and the head size is padded with zeros (scores unchanged).
    q = F.pad(
        query,
        (
            0,
            layout.padded_head_dim - head_dim,
            0,
            (layout.padded_kv_heads - layout.num_kv_heads) * group,
        ),
    )
    num_reqs = meta.seq_lens.shape[0]

    def kernel(q, kv_cache, seq_lens, block_tables, query_start_loc, num_seqs):
        return ragged_paged_attention(
            q,
            kv_cache,
            seq_lens,
            block_tables,
            query_start_loc,
            num_seqs,
            sm_scale=scale,
            sliding_window=window or None,
            soft_cap=softcap or None,
            use_kernel=True,
        )

    if meta.mesh is not None:
        # GSPMD cannot partition the kernel: each device runs it on its own heads.
        kernel = meta.mesh.per_device(kernel, KERNEL_SPECS, HEADS_SPEC)
    tables = meta.block_tables[:num_reqs]
    out = kernel(q, kv_cache, meta.seq_lens, tables, meta.query_start_loc, meta.num_seqs)
    return out[:, :num_heads, :head_dim]


register_attention_backend("xla_gather", gather_attention)
register_attention_backend("xla_ragged", ragged_attention)
