"""Per-device head and unit groups of a tensor-parallel TPU model (pure index arithmetic).

GSPMD shards a tensor in contiguous tiles. The model's fused projections stack their parts
(``q | k | v`` heads, ``gate | up`` units), so an even split of their columns would hand a device
the tail of one part and the head of the next; GSPMD would keep the math right by moving data
between devices in every layer. Instead the fused columns are reordered once, at load, so that
device i's tile holds whole groups:

- attention: ``q heads_i | k heads_i | v heads_i``, where device i owns KV heads
  ``[i * kl, (i + 1) * kl)`` and exactly the query heads that read them (GQA), so attention runs
  on each device over its own heads and only ``o_proj`` (row-parallel) sums across devices;
- MLP: ``gate units_i | up units_i``, so ``silu(gate) * up`` is local and only ``down_proj``
  (row-parallel) sums.

Counts that do not divide the device count are padded: KV heads up to a multiple of the devices
(each padded KV head brings its ``group`` zero query heads), MLP units likewise. Padded columns
and the matching rows of the row-parallel weights are zero, so they add exact zeros (e.g. the
default model's 3 KV / 9 query heads over 2 devices become 4 / 12: 2 KV and 6 query heads per
device, a third more attention work and KV memory than unpadded).

An index list maps each new column (or row) to the original one; ``-1`` is a zero pad.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PAD = -1  # index of a zero column / row in the maps below


def round_up(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class HeadGroups:
    """How one attention layer's heads are split over ``size`` devices."""

    size: int  # devices
    num_heads: int  # the model's query heads
    num_kv_heads: int  # the model's KV heads
    head_dim: int  # size of one head
    kv_per_device: int = 0  # KV heads each device holds (0 = the fewest that hold them all)

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA)."""
        return self.num_heads // self.num_kv_heads

    @property
    def padded_kv_heads(self) -> int:
        """KV heads after padding (a multiple of the devices)."""
        return self.local_kv_heads * self.size

    @property
    def padded_heads(self) -> int:
        """Query heads after padding (``group`` per padded KV head)."""
        return self.padded_kv_heads * self.group

    @property
    def local_kv_heads(self) -> int:
        """KV heads per device."""
        return self.kv_per_device or -(-self.num_kv_heads // self.size)

    @property
    def local_heads(self) -> int:
        """Query heads per device."""
        return self.local_kv_heads * self.group

    def qkv_columns(self) -> list[int]:
        """For each column of the regrouped fused projection, its column in the model's
        ``q | k | v`` layout (or PAD)."""
        d, q_cols, kv_cols = self.head_dim, self.num_heads, self.num_kv_heads
        cols: list[int] = []
        for dev in range(self.size):
            q = range(dev * self.local_heads, (dev + 1) * self.local_heads)
            kv = range(dev * self.local_kv_heads, (dev + 1) * self.local_kv_heads)
            cols += _head_columns(q, q_cols, 0, d)
            cols += _head_columns(kv, kv_cols, q_cols * d, d)
            cols += _head_columns(kv, kv_cols, (q_cols + kv_cols) * d, d)
        return cols

    def o_rows(self) -> list[int]:
        """For each row of the padded ``o_proj`` weight, its row in the model's (or PAD)."""
        return _head_columns(range(self.padded_heads), self.num_heads, 0, self.head_dim)


def _head_columns(heads: range, count: int, offset: int, head_dim: int) -> list[int]:
    """Columns of ``heads`` in a block of ``count`` heads starting at ``offset``; PAD for
    heads beyond ``count``."""
    cols: list[int] = []
    for h in heads:
        if h < count:
            cols += range(offset + h * head_dim, offset + (h + 1) * head_dim)
        else:
            cols += [PAD] * head_dim
    return cols


@dataclass(frozen=True)
class UnitGroups:
    """How a gated MLP's intermediate units are split over ``size`` devices."""

    size: int  # devices
    units: int  # the model's intermediate size

    @property
    def local_units(self) -> int:
        """Units per device (after padding)."""
        return round_up(self.units, self.size) // self.size

    def gate_up_columns(self) -> list[int]:
        """For each column of the regrouped ``gate | up`` projection, its column in the
        model's layout (or PAD)."""
        cols: list[int] = []
        for dev in range(self.size):
            units = range(dev * self.local_units, (dev + 1) * self.local_units)
            cols += [u if u < self.units else PAD for u in units]
            cols += [self.units + u if u < self.units else PAD for u in units]
        return cols

    def down_rows(self) -> list[int]:
        """For each row of the padded ``down_proj`` weight, its row in the model's (or PAD)."""
        total = self.local_units * self.size
        return [u if u < self.units else PAD for u in range(total)]


def take(tensor: torch.Tensor, index: list[int], dim: int) -> torch.Tensor:
    """``tensor`` reindexed along ``dim`` by ``index`` (PAD gives zeros); a new tensor."""
    pad_shape = list(tensor.shape)
    pad_shape[dim] = 1
    padded = torch.cat([tensor, tensor.new_zeros(pad_shape)], dim=dim)
    zero = tensor.shape[dim]
    idx = torch.tensor([zero if i == PAD else i for i in index], device=tensor.device)
    return padded.index_select(dim, idx).contiguous()
