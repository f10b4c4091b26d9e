"""The CPU's paged attention backend "cpu_paged" (kernel in paged_attention.cpp).

The kernel stores the step's new keys and values and attends every request, decodes and prefill
chunks alike, reading keys and values in place in the paged cache instead of gathering a padded
copy per request. Head sizes it does not take (not whole 16-float vectors, or over 128),
steps with no cache yet (memory profiling), and layers with a sliding window or attention
logit soft-capping (the kernel attends to the whole context, uncapped; logged once per
backend) use the torch implementation. Registered by
``register``; where the kernels cannot be built, the torch backend serves instead.
"""

from __future__ import annotations

import logging

import torch

from common.torch.attention import (
    AttentionMetadata,
    register_attention_backend,
    torch_paged_attention,
)
from executor_gpu.cpu.kernels import bf16_dot_enabled, load_kernels

log = logging.getLogger(__name__)

BACKEND_NAME = "cpu_paged"


def paged_attention_of(module):
    """The attention backend over the built kernels (bound once: no lookup per layer call)."""
    kernel, supports = module.paged_attention, module.paged_attention_supports
    bf16_dot = bf16_dot_enabled(module)  # a bf16 cache's scores on AVX-512 bf16 dot products
    logged = False  # whether the torch route of windowed / soft-capped layers was logged

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
        """query [T, heads, d], key / value [T, kv_heads, d] -> [T, heads, d]; the new keys
        and values are written to ``meta.slot_mapping`` first."""
        nonlocal logged
        if window > 0 or softcap > 0:
            if not logged:
                log.info(
                    "cpu_paged: layers with a sliding window or soft-capped attention logits "
                    "attend through the torch implementation (the kernel has neither)"
                )
                logged = True
            return torch_paged_attention(query, key, value, kv_cache, meta, scale, window, softcap)
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
            bf16_dot,
        )

    return backend


def register() -> bool:
    """Build the kernels and register the "cpu_paged" backend; False if they cannot be built."""
    module = load_kernels()
    if module is None:
        return False
    register_attention_backend(BACKEND_NAME, paged_attention_of(module))
    return True
