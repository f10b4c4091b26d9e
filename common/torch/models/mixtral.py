"""Mixtral: Llama attention (a sliding window where ``sliding_window`` is set) with a mixture
of experts (moe.py) on every layer: experts ``intermediate_size`` wide, top-k probabilities
always renormalized. The checkpoint's ``block_sparse_moe`` is this model's ``mlp``, and its
experts' ``w1`` / ``w3`` / ``w2`` are the gate / up / down projections."""

from __future__ import annotations

import torch
from torch import nn

from common.torch.models.linear import ShardedWeight
from common.torch.models.llama import LlamaArgs, LlamaDecoderLayer, LlamaForCausalLM
from common.torch.models.moe import MoeArgs, SparseMoeBlock, stack_all_experts


class MixtralExpert(nn.Module):
    """One expert's checkpoint weights under Mixtral's names."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, start: int | None = None):
        super().__init__()
        cols = None if start is None else [start]  # this rank's slice of the width, if any
        self.w1 = ShardedWeight(hidden, [inter], False, dtype, out_offsets=cols)  # gate
        self.w3 = ShardedWeight(hidden, [inter], False, dtype, out_offsets=cols)  # up
        self.w2 = ShardedWeight(inter, [hidden], False, dtype, in_offset=start)  # down

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate | up [hidden, 2 inter], down [inter, hidden])."""
        return torch.cat([self.w1.weight.data, self.w3.weight.data], dim=1), self.w2.weight.data


class MixtralDecoderLayer(LlamaDecoderLayer):
    """A Llama layer whose feed-forward block is a mixture of experts."""

    def make_mlp(self, args: LlamaArgs, dtype: torch.dtype, index: int) -> nn.Module:
        """The sparse block (every Mixtral layer has one)."""
        assert isinstance(args, MoeArgs)
        return SparseMoeBlock(args, dtype, MixtralExpert)


class MixtralForCausalLM(LlamaForCausalLM):
    """Mixtral checkpoints (``MixtralForCausalLM``)."""

    args_class = MoeArgs
    layer_class = MixtralDecoderLayer
    #: Llama's fused tensors, and block_sparse_moe -> mlp (expert tensors keep their names).
    stacked_params = [*LlamaForCausalLM.stacked_params, ("mlp", "block_sparse_moe", 0)]

    def post_load(self, device: torch.device | str) -> None:
        """Stack every layer's experts, then rebuild the RoPE table."""
        stack_all_experts(self)
        super().post_load(device)
