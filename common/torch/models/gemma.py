"""Gemma 2 and Gemma 3 (text, ``Gemma3ForCausalLM``) on Llama's building blocks.

What differs from Llama, each as transformers computes it:

- sliding-window layers alternating with global ones (``layer_types``; without it Gemma 2
  windows every other layer from the first, Gemma 3 five of every six), see
  common.wire.model_config.layer_windows;
- Gemma 3 rotates local (windowed) layers with their own RoPE base (``rope_parameters``
  keyed by layer type, or the older ``rope_local_base_freq``) and global layers with the
  global base and its scaling;
- queries scaled by ``query_pre_attn_scalar ** -0.5``, not ``head_dim ** -0.5``;
- attention logits soft-capped (``attn_logit_softcapping``, Gemma 2) and the final logits too
  (``final_logit_softcapping``): ``cap * tanh(x / cap)``;
- RMSNorm scaled by ``1 + weight`` in float32, and four per layer: around the attention and
  around the feed-forward block (``residual + post_norm(block(pre_norm(x)))``); Gemma 3 adds
  per-head query and key norms before the rotation;
- embeddings multiplied by ``sqrt(hidden_size)`` (rounded to the weights' dtype);
- a GELU (tanh approximation) gated MLP; tied input and output embeddings by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.torch.attention import AttentionMetadata
from common.torch.models.llama import (
    LlamaArgs,
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
)
from common.torch.models.rope import RotaryEmbedding
from common.torch.parallel import SINGLE, TensorParallel
from common.wire.model_config import layer_windows

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def _rope(params: dict[str, Any], default_theta: float) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling or None) of one RoPE parameter dict."""
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", default_theta))
    return theta, None if kind == "default" else {**params, "rope_type": kind}


@dataclass
class GemmaArgs(LlamaArgs):
    """Llama's hyper-parameters plus Gemma's."""

    query_scale: float  # queries are scaled by this (query_pre_attn_scalar ** -0.5)
    attn_softcap: float  # attention logit soft-cap (0 = none)
    final_softcap: float  # final logit soft-cap (0 = none)
    qk_norm: bool  # per-head query / key norms (Gemma 3)
    local_layers: list[bool]  # per layer: a local (sliding) layer, whatever its window
    local_rope_theta: float  # RoPE base of local layers
    local_rope_scaling: dict[str, Any] | None  # RoPE scaling of local layers

    @staticmethod
    def fields_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """Gemma's fields from a config dict (either RoPE key style)."""
        if cfg.get("use_bidirectional_attention"):
            raise ValueError("bidirectional Gemma attention is not supported (causal LMs only)")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in _GELU_TANH:
            raise ValueError(f"Gemma activation {act!r} is not supported ({_GELU_TANH})")
        rope = cfg.get("rope_parameters") or {}
        flat = {k: v for k, v in cfg.items() if k not in ("rope_parameters", "rope_scaling")}
        if "full_attention" in rope:  # per layer type (transformers 5's Gemma 3)
            flat["rope_parameters"] = rope["full_attention"]
            local_theta, local_scaling = _rope(rope.get("sliding_attention", {}), 10000.0)
        else:
            flat["rope_parameters"] = rope
            flat["rope_scaling"] = cfg.get("rope_scaling")
            # Gemma 3's local layers keep base 10k when an older config does not say.
            gemma3 = cfg.get("model_type", "").startswith("gemma3")
            local_theta = float(cfg.get("rope_local_base_freq") or (1e4 if gemma3 else 0.0))
            local_scaling = None
        fields = LlamaArgs.fields_from_config(flat)
        if not local_theta:  # one table for every layer (Gemma 2)
            local_theta, local_scaling = fields["rope_theta"], fields["rope_scaling"]
        is_local = layer_windows({**cfg, "sliding_window": 1})  # the layer types, window or not
        softcap = cfg.get("attn_logit_softcapping")
        final = cfg.get("final_logit_softcapping")
        return dict(
            fields,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            query_scale=float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
            attn_softcap=float(softcap or 0.0),
            final_softcap=float(final or 0.0),
            qk_norm=cfg.get("model_type", "").startswith("gemma3"),
            local_layers=[bool(w) for w in is_local],
            local_rope_theta=local_theta,
            local_rope_scaling=local_scaling,
        )


class GemmaRMSNorm(nn.Module):
    """RMSNorm scaled by ``1 + weight``, all in float32, cast back at the end (as Gemma)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize the last axis of x."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GemmaAttention(LlamaAttention):
    """Llama attention with Gemma's query scale, soft-cap, optional q/k norms and a RoPE table
    per layer type."""

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, index: int):
        super().__init__(args, dtype, index)
        self.scale = args.query_scale
        self.softcap = args.attn_softcap
        self.local = args.local_layers[index]  # rotated with the local RoPE table
        if args.qk_norm:
            self.q_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(args.head_dim, args.rms_norm_eps, dtype)


class GemmaMLP(LlamaMLP):
    """GELU (tanh approximation)-gated feed-forward block."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(LlamaDecoderLayer):
    """Attention and MLP, each wrapped in a pre- and a post-norm, with residual adds."""

    attention_class = GemmaAttention

    def __init__(self, args: GemmaArgs, dtype: torch.dtype, index: int):
        super().__init__(args, dtype, index)
        eps, size = args.rms_norm_eps, args.hidden_size
        self.input_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps, dtype)

    def make_mlp(self, args: LlamaArgs, dtype: torch.dtype, index: int) -> nn.Module:
        """Gemma's GELU MLP."""
        return GemmaMLP(args, dtype)

    def forward(
        self, rope: Any, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, None]:
        """The layer's output [T, hidden] (the residual stream is x itself: no residual is
        carried between layers, the second value is None)."""
        h = self.self_attn(rope, self.input_layernorm(x), meta)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h), None


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 (``Gemma2ForCausalLM``) and Gemma 3 text (``Gemma3ForCausalLM``) checkpoints."""

    args_class = GemmaArgs
    layer_class = GemmaDecoderLayer

    def __init__(
        self,
        config: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        max_model_len: int = 0,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__(config, dtype, max_model_len, tp)
        args = self.args
        self.model.norm = GemmaRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary_local = RotaryEmbedding(
            args.head_dim,
            self.model.rotary.max_positions,
            args.local_rope_theta,
            args.local_rope_scaling,
        )

    def post_load(self, device: torch.device | str) -> None:
        """Rebuild both RoPE tables."""
        super().post_load(device)
        self.rotary_local.rebuild(device)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm) of a flat batch of T tokens."""
        x = self.model.embed_tokens(input_ids)
        x = x * torch.tensor(self.args.hidden_size**0.5, dtype=x.dtype)
        ops = self.layer_ops
        ropes = {
            False: ops.rope_for_step(self.model.rotary.cos_sin, positions, x.dtype),
            True: ops.rope_for_step(self.rotary_local.cos_sin, positions, x.dtype),
        }
        for layer in self.model.layers:
            x, _ = layer(ropes[layer.self_attn.local], x, None, attn_metadata)
        return self.model.norm(x)

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of this rank's vocabulary, soft-capped where the config says."""
        logits = super().project_logits(hidden)
        cap = self.args.final_softcap
        return torch.tanh(logits / cap) * cap if cap > 0 else logits
