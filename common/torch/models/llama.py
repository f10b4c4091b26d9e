"""The Llama family (Llama, Mistral, Qwen2) in plain torch, over a paged KV cache; its
building blocks serve the other families too (qwen3.py, gemma.py, qwen3_moe.py).

The model takes a flat ragged batch of T tokens from several requests (``input_ids[T]``,
``positions[T]`` and the step's ``AttentionMetadata``) and returns the final-normed hidden state
of every token; ``compute_logits`` projects only the rows a step needs.

Query/key/value projections and gate/up projections are each fused into one matmul
(``qkv_proj``, ``gate_up_proj``); the weight loader fills their shards from the checkpoint's
separate tensors. Sliding-window layers (Mistral's ``sliding_window``; Qwen2 with
``use_sliding_window``) pass their window to the attention backend, which masks the keys that
fell out of it.

A family that differs only in parts subclasses the pieces: the model class names its
``args_class`` and ``layer_class``; an attention class may set ``q_norm`` / ``k_norm`` (per-head
norms of the queries and keys before the rotation).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from common.torch.attention import AttentionBackend, AttentionMetadata, get_attention_backend
from common.torch.models.layer_ops import TORCH_LAYER_OPS, LayerOps
from common.torch.models.linear import (
    Linear,
    VocabEmbedding,
    column_linear,
    row_linear,
)
from common.torch.models.rope import RotaryEmbedding
from common.torch.parallel import SINGLE, TensorParallel, head_shard, split_range
from common.wire.model_config import layer_windows

log = logging.getLogger(__name__)

# A device's whole-stack forward: (embeddings, positions, metadata) -> the final-normed hidden
# states, or None where it does not apply (then the layers run one by one).
StackForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], "torch.Tensor | None"]


@dataclass
class LlamaArgs:
    """Hyper-parameters of a Llama-family checkpoint, read from its config.json."""

    vocab_size: int  # rows of the embedding / logits width
    hidden_size: int  # model width
    intermediate_size: int  # MLP width
    num_layers: int  # decoder layers
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA)
    head_dim: int  # size of one head
    rms_norm_eps: float  # RMSNorm epsilon
    rope_theta: float  # RoPE base
    rope_scaling: dict[str, Any] | None  # RoPE scaling parameters; None = plain RoPE
    max_position_embeddings: int  # positions the model was trained for
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    qkv_bias: bool  # q/k/v projections have a bias (Qwen2, Llama attention_bias)
    o_bias: bool  # output projection has a bias (Llama attention_bias)
    mlp_bias: bool  # MLP projections have a bias
    windows: list[int]  # per layer: its sliding window in tokens, 0 = the whole context
    # How the layers are sharded over ranks (common.torch.parallel); not read from the config.
    tp: TensorParallel = field(default=SINGLE, kw_only=True)

    @classmethod
    def from_config(cls, cfg: dict[str, Any]) -> LlamaArgs:
        """Parse a checkpoint config.json dict (older and newer RoPE key styles)."""
        return cls(**cls.fields_from_config(cfg))

    @staticmethod
    def fields_from_config(cfg: dict[str, Any]) -> dict[str, Any]:
        """The fields of ``LlamaArgs`` read from a config dict (subclasses add theirs)."""
        heads = cfg["num_attention_heads"]
        rope = dict(cfg.get("rope_parameters") or {})
        legacy = cfg.get("rope_scaling")
        if legacy:
            rope.update(legacy)
        theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
        kind = rope.get("rope_type", rope.get("type", "default"))
        arch = (cfg.get("architectures") or [""])[0]
        attention_bias = bool(cfg.get("attention_bias", False))
        is_qwen2 = cfg.get("model_type") == "qwen2" or arch.startswith("Qwen2")
        return dict(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=None if kind == "default" else {**rope, "rope_type": kind},
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=is_qwen2 or attention_bias,
            o_bias=attention_bias and not is_qwen2,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            windows=layer_windows(cfg),
        )


class RMSNorm(nn.Module):
    """Root-mean-square norm, optionally of ``x + residual`` (the residual updated in place)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps
        self.ops: LayerOps = TORCH_LAYER_OPS

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize the last axis of x (of residual + x, stored into residual, if given)."""
        if residual is None:
            return self.ops.rms_norm(x, self.weight, self.eps)
        return self.ops.add_rms_norm(x, residual, self.weight, self.eps)


def norm_heads(norm: nn.Module, heads: torch.Tensor) -> torch.Tensor:
    """A norm over the last axis of every head: [T, n, d] -> [T, n, d] (a new tensor)."""
    t, n, d = heads.shape
    return norm(heads.reshape(t * n, d)).view(t, n, d)


class LlamaAttention(nn.Module):
    """Grouped-query self-attention over the paged KV cache (layer ``index`` of the stack)."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, index: int):
        super().__init__()
        tp, d = args.tp, args.head_dim
        heads = head_shard(args.num_heads, args.num_kv_heads, tp.size, tp.rank)
        self.num_heads = heads.q_count  # query heads of this rank (all of them for one rank)
        self.num_kv_heads = heads.kv_count  # key/value heads of this rank
        self.head_dim = d
        q_size, kv_size = heads.q_count * d, heads.kv_count * d
        self.qkv_proj = column_linear(
            tp,
            args.hidden_size,
            [q_size, kv_size, kv_size],
            [heads.q_start * d, heads.kv_start * d, heads.kv_start * d],
            args.qkv_bias,
            dtype,
        )
        self.o_proj = row_linear(
            tp, q_size, heads.q_start * d, args.hidden_size, args.o_bias, dtype
        )
        self.scale = args.head_dim**-0.5
        self.window = args.windows[index]  # sliding window (0 = the whole context)
        self.softcap = 0.0  # attention logit soft-capping (0 = none)
        # Per-head norms of the queries and of the keys before the rotation (set by the
        # families that have them: Qwen3, Gemma 3); None = none.
        self.q_norm: nn.Module | None = None
        self.k_norm: nn.Module | None = None
        self.kv_cache: torch.Tensor | None = None  # bound by LlamaForCausalLM.bind_kv_cache
        self.backend: AttentionBackend = get_attention_backend("torch")
        self.ops: LayerOps = TORCH_LAYER_OPS

    def forward(self, rope: Any, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; ``rope`` is the step's rotation (``LayerOps``)."""
        t = x.shape[0]
        qkv = self.qkv_proj(x).view(t, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
        # Queries and keys are adjacent heads: rotate them in one pass.
        qk = self.ops.rotary(self.qk_heads(qkv), self.num_heads + self.num_kv_heads, rope)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, self.num_heads + self.num_kv_heads :]
        out = self.backend(
            q, k, v, self.kv_cache, meta, self.scale, window=self.window, softcap=self.softcap
        )
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim))

    def qk_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        """The heads to rotate, queries then keys, from the projection [T, q + 2 kv heads, d]:
        the projection itself (the rotation takes its leading heads), or the normalized query
        and key heads [T, q + kv heads, d] where the layer has per-head norms."""
        if self.q_norm is None or self.k_norm is None:
            return qkv
        q = norm_heads(self.q_norm, qkv[:, : self.num_heads])
        k = norm_heads(self.k_norm, qkv[:, self.num_heads : self.num_heads + self.num_kv_heads])
        return torch.cat([q, k], dim=1)


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, args: LlamaArgs, dtype: torch.dtype):
        super().__init__()
        tp = args.tp
        start, stop = split_range(args.intermediate_size, tp.size, tp.rank)
        inter = stop - start  # this rank's slice of the MLP width
        self.gate_up_proj = column_linear(
            tp, args.hidden_size, [inter, inter], [start, start], args.mlp_bias, dtype
        )
        self.down_proj = row_linear(tp, inter, start, args.hidden_size, args.mlp_bias, dtype)
        self.ops: LayerOps = TORCH_LAYER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residual connections."""

    attention_class: type[LlamaAttention] = LlamaAttention

    def __init__(self, args: LlamaArgs, dtype: torch.dtype, index: int):
        super().__init__()
        self.self_attn = self.attention_class(args, dtype, index)
        self.mlp = self.make_mlp(args, dtype, index)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(
        self, rope: Any, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer. The residual stream is carried separately: the layer's input is
        ``residual + x`` (just ``x`` for the first layer, residual None), which the input norm
        forms in place; returns (this layer's MLP output, the residual stream before it)."""
        if residual is None:
            residual = x
            h = self.input_layernorm(x)
        else:
            h = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(rope, h, meta), residual)
        return self.mlp(h), residual

    def make_mlp(self, args: LlamaArgs, dtype: torch.dtype, index: int) -> nn.Module:
        """The feed-forward block of layer ``index`` (a mixture of experts may differ)."""
        return LlamaMLP(args, dtype)


class LlamaModel(nn.Module):
    """Embeddings, decoder stack and final norm."""

    def __init__(
        self,
        args: LlamaArgs,
        max_positions: int,
        dtype: torch.dtype,
        layer_class: type[LlamaDecoderLayer],
    ):
        super().__init__()
        self.embed_tokens: nn.Module = (
            VocabEmbedding(args.vocab_size, args.hidden_size, dtype, args.tp)
            if args.tp.size > 1
            else nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        )
        self.rotary = RotaryEmbedding(
            args.head_dim, max_positions, args.rope_theta, args.rope_scaling
        )
        self.layers = nn.ModuleList(layer_class(args, dtype, i) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)


class LlamaForCausalLM(nn.Module):
    """A Llama-family causal LM over a paged KV cache (also Mistral and Qwen2 checkpoints).

    Parameter names follow the checkpoint's (``model.layers.N.self_attn...``) except for the
    fused ``qkv_proj`` / ``gate_up_proj``; see ``stacked_params``. Subclasses for other
    families set ``args_class`` and ``layer_class``.
    """

    args_class: type[LlamaArgs] = LlamaArgs
    layer_class: type[LlamaDecoderLayer] = LlamaDecoderLayer

    #: (fused parameter, checkpoint name part, shard index) for the weight loader.
    stacked_params = [
        ("qkv_proj", "q_proj", 0),
        ("qkv_proj", "k_proj", 1),
        ("qkv_proj", "v_proj", 2),
        ("gate_up_proj", "gate_proj", 0),
        ("gate_up_proj", "up_proj", 1),
    ]

    def __init__(
        self,
        config: dict[str, Any],
        dtype: torch.dtype = torch.float32,
        max_model_len: int = 0,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.args = self.args_class.from_config(config)
        self.args.tp = tp  # how the layers below are sharded
        self.dtype = dtype
        max_positions = max(self.args.max_position_embeddings, max_model_len)
        self.model = LlamaModel(self.args, max_positions, dtype, self.layer_class)
        self.layer_ops: LayerOps = TORCH_LAYER_OPS
        # The output embedding in the form layer_ops.logits takes (None: lm_head.weight as is).
        self.logits_weight: torch.Tensor | None = None
        # A device's whole-stack forward (see StackForward), or None: the layers one by one.
        self.stack_forward: StackForward | None = None
        self.lm_head: nn.Module = (
            VocabEmbedding(self.args.vocab_size, self.args.hidden_size, dtype, tp)
            if tp.size > 1
            else nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False, dtype=dtype)
        )
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def tie_weights(self) -> None:
        """Re-share lm_head with the embeddings (after moving parameters)."""
        if self.args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def post_load(self, device: torch.device | str) -> None:
        """Rebuild buffers that are not loaded from the checkpoint (the RoPE table)."""
        self.model.rotary.rebuild(device)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor] | None) -> None:
        """Attach one KV tensor per layer (see common.torch.attention for the layout); None
        unbinds."""
        for i, layer in enumerate(self.model.layers):
            layer.self_attn.kv_cache = None if kv_caches is None else kv_caches[i]

    def set_layer_ops(self, ops: LayerOps) -> None:
        """Use ``ops`` for every layer's linear layers, norms, rotary embedding and
        SiLU-and-multiply, and for the logits. Call once, after the weights are loaded: the
        linear layers' weights and the output embedding are converted to the layouts ``ops``
        takes (a tied output embedding keeps its input-embedding original beside the copy)."""
        self.layer_ops = ops
        for module in self.modules():
            if hasattr(module, "ops"):
                module.ops = ops
            if isinstance(module, Linear):
                module.weight.data = ops.prepare_linear(module.weight.data)
        embedding = self.lm_head.weight.data
        prepared = ops.prepare_logits(embedding)
        self.logits_weight = None if prepared is embedding else prepared
        if self.logits_weight is not None and not self.args.tie_word_embeddings:
            self.lm_head.weight.data = prepared  # the original is needed no more

    def stack_forward_applies(self) -> bool:
        """Whether a device's whole-stack forward (which computes plain Llama layers over
        whole-context attention) may replace this model's layers: not with sliding windows,
        nor in families whose layers differ (they override this)."""
        return (
            type(self).layer_class is LlamaDecoderLayer
            and not any(self.args.windows)
            and self.args.tp.size == 1
        )

    def set_stack_forward(self, fn: StackForward | None) -> None:
        """Run the decoder layers and final norm through ``fn`` where it applies; it must compute
        what the layers compute (see ``forward``). Ignored (logged) for a model whose layers
        ``fn`` would not compute (``stack_forward_applies``)."""
        if fn is not None and not self.stack_forward_applies():
            log.info(
                "%s: the one-call decoder stack does not apply (sliding windows or other layer "
                "math); the layers run one by one",
                type(self).__name__,
            )
            fn = None
        self.stack_forward = fn

    def set_attention_backend(self, name: str) -> None:
        """Select the attention implementation registered under ``name``."""
        backend = get_attention_backend(name)
        for layer in self.model.layers:
            layer.self_attn.backend = backend

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attn_metadata: AttentionMetadata
    ) -> torch.Tensor:
        """Hidden states [T, hidden] (after the final norm) of a flat batch of T tokens."""
        x = self.model.embed_tokens(input_ids)
        if self.stack_forward is not None:
            hidden = self.stack_forward(x, positions, attn_metadata)
            if hidden is not None:
                return hidden
        rope = self.layer_ops.rope_for_step(self.model.rotary.cos_sin, positions, x.dtype)
        residual = None
        for layer in self.model.layers:
            x, residual = layer(rope, x, residual, attn_metadata)
        return self.model.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits [S, vocab] of the selected hidden rows [S, hidden]; under tensor
        parallelism every rank computes its slice of the vocabulary and rank 0 gets them all
        (the other ranks get None)."""
        return self.args.tp.gather_vocab(self.project_logits(hidden), self.args.vocab_size)

    def project_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of hidden rows against the output embedding this rank holds."""
        weight = self.logits_weight if self.logits_weight is not None else self.lm_head.weight
        return self.layer_ops.logits(hidden, weight)
