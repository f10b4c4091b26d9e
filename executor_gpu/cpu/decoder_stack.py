"""The whole decoder stack in one kernel call (decoder_stack.cpp) for float32 and bf16 models.

``stack_forward_of`` returns a function the model calls instead of looping over its layers in
Python: it hands the step's embeddings, every layer's weights and KV cache and the step's
attention metadata to one C++ call that runs the same kernels in the same order (so the output
is identical) without the interpreter between them, and with the GIL released. It declines
(returns None, and the model runs its layers itself) where the kernels would not all apply:
weights not packed, no KV cache bound (memory profiling), another attention backend, or a head
size the attention kernel does not take.
"""

from __future__ import annotations

import torch

from common.torch.attention import AttentionMetadata
from common.torch.models.llama import StackForward


def _layer_tensors(layer, empty: torch.Tensor) -> list[torch.Tensor] | None:
    """One layer's tensors in the kernel's order, or None if a weight is not packed."""
    attn, mlp = layer.self_attn, layer.mlp
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    if any(lin.weight.dim() < 3 for lin in linears):  # 3-D panels, or 4-D bf16 pairs
        return None
    qkv, o, gate_up, down = (
        (lin.weight, lin.bias if lin.bias is not None else empty) for lin in linears
    )
    return [
        layer.input_layernorm.weight,
        *qkv,
        *o,
        layer.post_attention_layernorm.weight,
        *gate_up,
        *down,
        attn.kv_cache,
    ]


def stack_forward_of(module, model, backend) -> StackForward:
    """The one-call forward of ``model`` (a LlamaForCausalLM with the CPU layer ops set) over
    the built kernels ``module``; it applies while every layer attends with ``backend``."""
    kernel = module.decoder_stack
    args = model.args
    supported = module.paged_attention_supports(args.head_dim)
    per_layer = module.DECODER_STACK_TENSORS_PER_LAYER
    layers = model.model.layers
    built_for: torch.Tensor | None = None  # the KV cache the flat list was built for
    flat: list[torch.Tensor] | None = None  # every layer's tensors, or None if one is unpacked

    def flat_tensors() -> list[torch.Tensor] | None:
        nonlocal built_for, flat
        cache = layers[0].self_attn.kv_cache
        if built_for is not cache:  # built once per bound KV cache
            empty = torch.empty(0)
            parts = [_layer_tensors(layer, empty) for layer in layers]
            if any(p is not None and len(p) != per_layer for p in parts):
                raise RuntimeError(f"decoder_stack takes {per_layer} tensors per layer")
            flat = None if any(p is None for p in parts) else [t for p in parts for t in p]
            built_for = cache
        return flat

    def forward(
        x: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor | None:
        if (
            not supported
            or layers[0].self_attn.kv_cache is None
            or layers[0].self_attn.backend is not backend
        ):
            return None
        tensors = flat_tensors()
        if tensors is None:
            return None
        return kernel(
            x,
            tensors,
            model.model.norm.weight,
            positions,
            model.model.rotary.cos_sin,
            meta.slot_mapping,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            args.num_heads,
            args.num_kv_heads,
            args.rms_norm_eps,
            layers[0].self_attn.scale,
        )

    return forward
