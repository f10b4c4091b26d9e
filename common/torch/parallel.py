"""Tensor parallelism inside a model: which slice of each weight a rank holds, and the two
collectives the sharded layers need.

A model built with a ``TensorParallel`` of size N > 1 holds 1/N of the work on each rank:

- attention heads are split by whole GQA groups: each rank holds a contiguous run of key/value
  heads and the query heads that read them (``head_shard``); where there are fewer key/value
  heads than ranks, each key/value head is replicated on N / kv ranks and its query heads are
  divided between them. Counts that do not divide evenly give some ranks one head more.
- the fused q|k|v and gate|up projections are column-parallel (each rank computes its heads' /
  its MLP slice's outputs, no communication); the output and down projections are
  row-parallel (each rank multiplies its slice of the inputs; the partial sums are all-reduced).
- the embedding and the output projection are split over the vocabulary (``vocab_shard``, rows
  padded to an equal count per rank): a lookup is masked to the rank's rows and all-reduced,
  and each rank's slice of the logits is gathered to rank 0, which samples.

Nothing here starts processes or groups; executor_gpu.parallel does (and size 1 is the plain
single-device model: every slice is the whole tensor and no collective runs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


def split_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """``[start, stop)`` of part ``index`` when ``n`` items are cut into ``parts`` contiguous
    runs whose lengths differ by at most one (the first ``n % parts`` runs are longer)."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    """The attention heads one rank holds."""

    q_start: int  # first query head
    q_count: int  # query heads
    kv_start: int  # first key/value head
    kv_count: int  # key/value heads


def head_shard(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadShard:
    """The heads of ``rank`` among ``size`` ranks (see the module's description). Raises for
    head counts no rank layout serves (fewer query heads than ranks, or key/value heads that
    cannot be replicated evenly)."""
    if size == 1:
        return HeadShard(0, num_heads, 0, num_kv_heads)
    group = num_heads // num_kv_heads  # query heads per key/value head
    if num_kv_heads >= size:
        kv_start, kv_stop = split_range(num_kv_heads, size, rank)
        return HeadShard(
            kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start
        )
    replicas = size // num_kv_heads
    if size % num_kv_heads or group < replicas:
        raise ValueError(
            f"tensor parallel size {size} does not fit {num_heads} query / {num_kv_heads} "
            f"key-value heads (with fewer key/value heads than ranks, the ranks must be a "
            f"multiple of them and each key/value head must have a query head per replica)"
        )
    kv = rank // replicas
    q_start, q_stop = split_range(group, replicas, rank % replicas)
    return HeadShard(kv * group + q_start, q_stop - q_start, kv, 1)


def stored_kv_heads(num_heads: int, num_kv_heads: int, size: int) -> int:
    """Key/value heads stored over all ranks (more than the model's where they are
    replicated): what one KV block costs the executor as a whole."""
    return sum(head_shard(num_heads, num_kv_heads, size, r).kv_count for r in range(size))


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (size 1: no parallelism)."""

    rank: int = 0  # this process's rank; 0 samples and talks to the controller
    size: int = 1  # ranks sharing the model
    group: Any = None  # torch.distributed process group of the ranks (None for size 1)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (a no-op for one rank); returns it."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def vocab_shard(self, vocab_size: int) -> tuple[int, int]:
        """``[start, start + rows)`` of the vocabulary this rank holds: equal row counts per
        rank (ceil), the last rank's rows past the vocabulary padded."""
        rows = -(-vocab_size // self.size)
        return self.rank * rows, rows

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's [S, rows] slice of the logits -> the full [S, vocab] on rank 0; None on
        the other ranks."""
        if self.size == 1:
            return local
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local, parts, dst=self._global(0), group=self.group)
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def _global(self, rank: int) -> int:
        """The global rank of group rank ``rank`` (the group may be a subgroup)."""
        return dist.get_global_rank(self.group, rank) if self.group is not None else rank


#: No parallelism: the whole model on one device.
SINGLE = TensorParallel()
