"""Qwen3-MoE: Qwen3 attention (per-head q/k norms) with a mixture-of-experts feed-forward
block (moe.py) on the layers the config makes sparse: all but those in ``mlp_only_layers`` or
off the ``decoder_sparse_step`` grid, which keep a dense MLP of ``intermediate_size``. The
top-k probabilities are renormalized when ``norm_topk_prob`` says so."""

from __future__ import annotations

import torch
from torch import nn

from common.torch.models.llama import LlamaArgs, LlamaMLP
from common.torch.models.moe import MoeArgs, SparseMoeBlock, stack_all_experts
from common.torch.models.qwen3 import Qwen3DecoderLayer, Qwen3ForCausalLM


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    """A Qwen3 layer whose feed-forward block is a mixture of experts where the config says."""

    def make_mlp(self, args: LlamaArgs, dtype: torch.dtype, index: int) -> nn.Module:
        """The sparse block on sparse layers, a dense MLP elsewhere."""
        assert isinstance(args, MoeArgs)
        if args.sparse_layers[index]:
            return SparseMoeBlock(args, dtype)
        return LlamaMLP(args, dtype)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE checkpoints (``Qwen3MoeForCausalLM``)."""

    args_class = MoeArgs
    layer_class = Qwen3MoeDecoderLayer

    def post_load(self, device: torch.device | str) -> None:
        """Stack every sparse layer's experts, then rebuild the RoPE table."""
        stack_all_experts(self)
        super().post_load(device)
