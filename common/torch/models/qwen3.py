"""Qwen3: the Llama layers with an RMSNorm over each query and key head before the rotation.

Everything else is Llama's (no q/k/v bias unless ``attention_bias``; sliding windows only with
``use_sliding_window``, see common.wire.model_config.layer_windows). The norms' weights are the
checkpoint's ``self_attn.q_norm`` / ``self_attn.k_norm`` ([head_dim] each, shared by the heads).
"""

from __future__ import annotations

import torch

from common.torch.models.llama import (
    LlamaArgs,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    RMSNorm,
)


class Qwen3Attention(LlamaAttention):
    """Llama attention with per-head query and key norms (before RoPE)."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, index: int):
        super().__init__(args, dtype, index)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype)


class Qwen3DecoderLayer(LlamaDecoderLayer):
    """A Llama decoder layer over Qwen3 attention."""

    attention_class = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 checkpoints (``Qwen3ForCausalLM``)."""

    layer_class = Qwen3DecoderLayer
