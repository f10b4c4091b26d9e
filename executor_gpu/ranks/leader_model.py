"""The model as rank 0 of a tensor-parallel executor sees it.

Rank 0's runner drives its model as if it were alone; ``LeaderModel`` stands in for the model
and, before each call that runs collectives or touches the KV cache, sends the same call to
the followers (executor_gpu.follower), so that every rank runs it on its shard in lockstep:

- a forward pass: the step's inputs (token ids, positions, attention metadata) go as CPU
  tensors; each follower moves them to its device;
- logits: the selected hidden rows go (the hidden states are the same on every rank after the
  final all-reduce, but only rank 0 knows which rows a step projects); rank 0 gets the whole
  vocabulary back, the followers nothing;
- binding or unbinding the KV cache (fabricated warm-up runs unbind it), and zeroing the
  slots of a failed request.

Everything else (parameters, arguments, layer ops) is the local model's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from common.torch.attention import AttentionMetadata
from executor_gpu.ranks.group import RankGroup, collective_guard


def host_copy(meta: AttentionMetadata) -> AttentionMetadata:
    """The metadata with its tensors on the host and nothing derived (to send)."""
    fields = {
        f.name: getattr(meta, f.name).cpu()
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, derived={}, **fields)


def on_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    """Received metadata with its tensors moved to ``device``."""
    fields = {
        f.name: getattr(meta, f.name).to(device)
        for f in dataclasses.fields(meta)
        if isinstance(getattr(meta, f.name), torch.Tensor)
    }
    return dataclasses.replace(meta, **fields)


class LeaderModel:
    """Rank 0's model: the local shard, each collective call mirrored on the followers."""

    def __init__(self, model: Any, group: RankGroup):
        self.local = model  # rank 0's shard
        self.group = group  # the followers
        self._forward = collective_guard(group, model.__call__)
        self._logits = collective_guard(group, model.compute_logits)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.local, name)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """The forward pass on every rank; rank 0's hidden states."""
        self.group.send("forward", input_ids.cpu(), positions.cpu(), host_copy(meta))
        return self._forward(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [S, vocab] of the hidden rows, each rank projecting its vocabulary slice."""
        self.group.send("logits", hidden.cpu())
        return self._logits(hidden)

    def bind_kv_cache(self, kv_caches: list[torch.Tensor] | None) -> None:
        """Bind (a list) or unbind (None) the cache on every rank (each binds its own)."""
        self.group.send("bind", kv_caches is not None)
        self.local.bind_kv_cache(kv_caches)

    def scrub_slots(self, slots: torch.Tensor) -> None:
        """Have the followers zero these cache slots in their shards (rank 0 does its own)."""
        self.group.send("scrub", slots.cpu())
