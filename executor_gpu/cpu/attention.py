"""The CPU's paged attention backend "cpu_paged" (kernel in paged_attention.cpp).

The kernel stores the step's new keys and values and attends every request, decodes and prefill
chunks alike, reading keys and values in place in the paged cache instead of gathering a padded
copy per request. Head sizes it does not take (not whole 16-float vectors, or over 128), and
steps with no cache yet (memory profiling), use the torch implementation. Registered by
``register``; where the kernels cannot be built, the torch backend serves instead.
"""

from __future__ import annotations

import torch

from common.torch.attention import (
    AttentionMetadata,
    register_attention_backend,
    torch_paged_attention,
)
from executor_gpu.cpu.kernels import load_kernels

BACKEND_NAME = "cpu_paged"


def paged_attention_of(module):
    """The attention backend over the built kernels (bound once: no lookup per layer call)."""
    kernel, supports = module.paged_attention, module.paged_attention_supports

    def backend(
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor | None,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """query [T, heads, d], key / value [T, kv_heads, d] -> [T, heads, d]; the new keys
        and values are written to ``meta.slot_mapping`` first."""
        if kv_cache is None or not supports(query.shape[-1]):
            return torch_paged_attention(query, key, value, kv_cache, meta, scale)
        return kernel(
            query,
            key,
            value,
            meta.slot_mapping,
            kv_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
        )

    return backend


def register() -> bool:
    """Build the kernels and register the "cpu_paged" backend; False if they cannot be built."""
    module = load_kernels()
    if module is None:
        return False
    register_attention_backend(BACKEND_NAME, paged_attention_of(module))
    return True
