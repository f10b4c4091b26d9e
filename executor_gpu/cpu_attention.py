"""The CPU's decode attention backend "cpu_paged" (kernel in cpu_paged_attention.cpp).

The kernel reads keys and values in place in the paged cache instead of gathering a padded copy
per step, and stores the decoding requests' new keys and values itself. Longer query chunks
(prefills) use the torch implementation. Registered by ``register``; where the kernels cannot be
built, the torch backend serves instead.
"""

from __future__ import annotations

import torch

from common.attention import (
    AttentionMetadata,
    paged_attention_with,
    register_attention_backend,
)
from executor_gpu.cpu_kernels import load_kernels

BACKEND_NAME = "cpu_paged"


def decode_attention_of(module):
    """The decode attention of the built kernels (bound once: no lookup per layer call)."""
    kernel = module.paged_decode_attention

    def decode(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float, key: torch.Tensor | None = None,
               value: torch.Tensor | None = None) -> torch.Tensor:
        """Single-token requests' attention, [N, heads, d]; with ``key`` / ``value`` ([N,
        kv_heads, d]) given, their cache slots are written first."""
        n = query.shape[0]
        slots = meta.slot_mapping[:n] if key is not None else None
        return kernel(query, key, value, slots, kv_cache, meta.block_tables[:n],
                      meta.seq_lens[:n], scale)

    decode.stores_kv = True  # paged_attention_with leaves the decodes' KV writes to it
    return decode


def register() -> bool:
    """Build the kernels and register the "cpu_paged" backend; False if they cannot be built."""
    module = load_kernels()
    if module is None:
        return False
    register_attention_backend(BACKEND_NAME, paged_attention_with(decode_attention_of(module)))
    return True
