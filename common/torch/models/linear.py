"""The linear building blocks of the model families, and how tensor parallelism slices them.

``ShardedWeight`` holds a weight stored [in, out] (the checkpoint's transpose) whose columns may
stack several checkpoint tensors (q|k|v, gate|up) and, under tensor parallelism, a slice of
each; ``Linear`` multiplies by it (all-reducing the partial sums where it is row-parallel);
``column_linear`` / ``row_linear`` build the two kinds; ``VocabEmbedding`` holds one rank's
rows of an embedding or output projection. See common.torch.parallel for the layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from common.torch.models.layer_ops import TORCH_LAYER_OPS, LayerOps
from common.torch.parallel import TensorParallel


class ShardedWeight(nn.Module):
    """A weight stored [in, out] (the checkpoint's transpose) whose output columns may stack
    several checkpoint tensors (``shard_sizes``, e.g. q|k|v); ``load_tensor`` fills them.

    Under tensor parallelism the weight holds a slice of each checkpoint tensor: rows
    ``out_offsets[i]...`` of stacked tensor i (column-parallel), or input columns
    ``in_offset...`` (row-parallel; then only the rank with ``owns_bias`` adds the bias, the
    others hold zeros, so that the all-reduced sum adds it once).
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: list[int],
        bias: bool,
        dtype: torch.dtype,
        *,
        out_offsets: list[int] | None = None,
        in_offset: int | None = None,
        owns_bias: bool = True,
    ):
        super().__init__()
        self.shard_sizes = list(shard_sizes)  # output columns of each stacked checkpoint tensor
        self.out_offsets = out_offsets  # per stacked tensor: its first row held (None: all)
        self.in_offset = in_offset  # first input column held (None: all)
        self.owns_bias = owns_bias  # whether this rank adds the bias (row-parallel)
        out = sum(shard_sizes)
        self.weight = nn.Parameter(torch.empty(in_features, out, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out, dtype=dtype)) if bias else None

    def shard_slice(self, shard: int) -> slice:
        """Output columns holding shard ``shard``."""
        start = sum(self.shard_sizes[:shard])
        return slice(start, start + self.shard_sizes[shard])

    def load_tensor(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy a checkpoint tensor (``weight`` [out, in] or ``bias`` [out]) into shard."""
        cols = self.shard_slice(shard)
        if self.out_offsets is not None:  # this rank's rows of the checkpoint tensor
            start = self.out_offsets[shard]
            tensor = tensor[start : start + self.shard_sizes[shard]]
        if param == "weight":
            if self.in_offset is not None:  # this rank's input columns
                tensor = tensor[:, self.in_offset : self.in_offset + self.weight.shape[0]]
            dest, src = self.weight.data[:, cols], tensor.t()
        elif param == "bias" and self.bias is not None:
            dest, src = self.bias.data[cols], tensor
            if not self.owns_bias:
                src = torch.zeros_like(dest)
        else:
            raise KeyError(f"no parameter {param!r}")
        if dest.shape != src.shape:
            raise ValueError(
                f"{param} shard {shard}: checkpoint {tuple(tensor.shape)} does not "
                f"fit {tuple(dest.shape)}"
            )
        dest.copy_(src)


class Linear(ShardedWeight):
    """``y = x @ weight + bias`` with ``weight`` stored [in, out] (the checkpoint's transpose).

    The [in, out] layout makes the matmul a plain (non-transposed) GEMM, which several BLAS
    libraries run much faster for the small row counts of decode steps.
    """

    # The layer ops in use (LlamaForCausalLM.set_layer_ops sets them per layer).
    ops: LayerOps = TORCH_LAYER_OPS
    # Row-parallel: the group whose partial outputs are summed (None: the whole output).
    reduce: TensorParallel | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]."""
        y = self.ops.linear(x, self.weight, self.bias)
        return self.reduce.all_reduce(y) if self.reduce is not None else y


def column_linear(
    tp: TensorParallel, in_features: int, sizes: list[int], offsets: list[int], bias: bool, dtype
) -> Linear:
    """A column-parallel linear layer: this rank's ``sizes`` output columns of each stacked
    checkpoint tensor, from ``offsets`` (the whole tensors for one rank)."""
    return Linear(in_features, sizes, bias, dtype, out_offsets=offsets if tp.size > 1 else None)


def row_linear(
    tp: TensorParallel, in_features: int, offset: int, out_features: int, bias: bool, dtype
) -> Linear:
    """A row-parallel linear layer: this rank's ``in_features`` inputs from ``offset``; the
    ranks' partial outputs are all-reduced (the bias added once)."""
    if tp.size == 1:
        return Linear(in_features, [out_features], bias, dtype)
    layer = Linear(
        in_features, [out_features], bias, dtype, in_offset=offset, owns_bias=tp.rank == 0
    )
    layer.reduce = tp
    return layer


class VocabEmbedding(nn.Module):
    """The rows of an embedding (or output projection) [vocab, hidden] one rank holds under
    tensor parallelism (``TensorParallel.vocab_shard``; rows past the vocabulary are zero). A
    lookup of a token outside the rank's rows gives zeros, and the ranks' lookups are summed."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, tp: TensorParallel):
        super().__init__()
        self.tp = tp
        self.start, rows = tp.vocab_shard(vocab_size)
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype))

    def load_tensor(self, param: str, tensor: torch.Tensor, shard: int = 0) -> None:
        """Copy this rank's rows of the checkpoint's [vocab, hidden] tensor (zero padding)."""
        if param != "weight":
            raise KeyError(f"no parameter {param!r}")
        part = tensor[self.start : self.start + self.weight.shape[0]]
        self.weight.data.zero_()
        self.weight.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Embeddings [T, hidden] of input_ids [T] (summed over the ranks)."""
        local = input_ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(torch.where(inside, local, 0), self.weight)
        return self.tp.all_reduce(x * inside[:, None].to(x.dtype))
