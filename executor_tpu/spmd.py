"""The devices of a tensor-parallel TPU executor: torch_xla SPMD over one host's chips.

With ``--tensor-parallel-size N`` (N > 1) the executor runs torch_xla in SPMD mode: one program
per shape, compiled once for a one-axis device mesh ``("tp",)`` of N devices and partitioned by
XLA (GSPMD) from the sharding annotations placed on the weights, the KV cache and the attention
heads (``executor_tpu.tp_model``). The controller still sees one executor.

XLA's SPMD mesh must span every device the process sees: on a TPU host N must equal the chips
visible to the process (``TPU_VISIBLE_CHIPS`` and the process bounds narrow them); on XLA:CPU
the executor asks PJRT for N virtual CPU devices (``CPU_NUM_DEVICES``), which is how the
sharded executor is developed and tested without a TPU. ``prepare_devices`` runs before
torch_xla starts its runtime; ``start_spmd`` after.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger(__name__)

AXIS = "tp"  # the mesh axis every sharded dimension is split over
Spec = tuple[str | None, ...]  # a partition spec: per tensor dimension, AXIS or None


def visible_chips() -> int:
    """TPU chips this process will see (``TPU_VISIBLE_CHIPS``, else the host's accelerator
    device files); 0 = unknown."""
    listed = os.environ.get("TPU_VISIBLE_CHIPS", "").strip()
    if listed:
        return len(listed.split(","))
    return len(glob.glob("/dev/accel[0-9]*") or glob.glob("/dev/vfio/[0-9]*"))


def prepare_devices(size: int, pjrt_device: str) -> None:
    """Before torch_xla starts: on XLA:CPU, ask for ``size`` virtual devices. Raises
    ValueError when ``CPU_NUM_DEVICES`` is already set to another count, or when a TPU host
    shows another number of chips (the SPMD mesh must span them all)."""
    if size <= 1:
        return
    if pjrt_device == "TPU":
        chips = visible_chips()
        if chips and chips != size:
            raise ValueError(
                f"--tensor-parallel-size {size}: this process sees {chips} TPU chips; SPMD "
                "shards over all of them (set TPU_VISIBLE_CHIPS, or the size to the chip count)"
            )
        return
    have = os.environ.get("CPU_NUM_DEVICES")
    if have and int(have) != size:
        raise ValueError(
            f"--tensor-parallel-size {size} on XLA:CPU needs CPU_NUM_DEVICES={size} (it is {have})"
        )
    os.environ["CPU_NUM_DEVICES"] = str(size)


@dataclass
class SpmdMesh:
    """A one-axis mesh over the host's devices, and the annotations placed with it."""

    size: int  # devices the model is sharded over
    mesh: Any  # torch_xla.distributed.spmd.Mesh of shape (size,), axis AXIS
    chip_limits: list[int]  # each TPU chip's memory limit in bytes ([] on XLA:CPU)

    def shard(self, tensor: torch.Tensor, spec: Spec) -> torch.Tensor:
        """Annotate an XLA tensor (device data or a lazy value) with ``spec``; returns it."""
        import torch_xla.distributed.spmd as xs

        if AXIS in spec:
            xs.mark_sharding(tensor, self.mesh, spec)
        return tensor

    def replicate(self, tensor: torch.Tensor) -> torch.Tensor:
        """Annotate a lazy XLA value to be whole on every device; returns it."""
        import torch_xla.distributed.spmd as xs

        xs.mark_sharding(tensor, self.mesh, (None,) * tensor.dim())
        return tensor

    def per_device(
        self, fn: Callable[..., torch.Tensor], in_specs: tuple[Spec, ...], out_spec: Spec
    ) -> Callable[..., torch.Tensor]:
        """``fn`` run by each device on its own shards (a manual region: XLA does not
        partition what it computes), its inputs split by ``in_specs`` and its output, local on
        each device, joined back by ``out_spec``."""
        import torch_xla.distributed.spmd as xs

        def run(*args: torch.Tensor) -> torch.Tensor:
            local = [
                xs.enable_manual_sharding(a, spec, mesh=self.mesh).global_tensor
                for a, spec in zip(args, in_specs, strict=True)
            ]
            out = fn(*local)
            full = [n * self.size if part == AXIS else n for n, part in zip(out.shape, out_spec)]
            return xs.disable_manual_sharding(out, out_spec, full, mesh=self.mesh).global_tensor

        return run

    def heads(self, tensor: torch.Tensor) -> torch.Tensor:
        """Constrain per-head activations [T, heads, d] to be split over their heads."""
        return self.shard(tensor, (None, AXIS, None))


def start_spmd(size: int, on_tpu: bool) -> SpmdMesh:
    """Switch torch_xla to SPMD (before any XLA tensor exists) and build the mesh. Raises
    ValueError when the process does not see exactly ``size`` devices."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    # Under SPMD, torch_xla 2.9 reports no memory statistics per chip (only for the virtual
    # device, which has none): read the chips' limits first.
    limits = chip_limits(size) if on_tpu else []
    xr.use_spmd()
    count = xr.global_runtime_device_count()
    if count != size:
        raise ValueError(
            f"--tensor-parallel-size {size}: this process sees {count} devices; SPMD shards "
            "over all of them (set TPU_VISIBLE_CHIPS, or the size to the chip count)"
        )
    log.info("SPMD: the model is sharded over %d devices (mesh axis %r)", size, AXIS)
    return SpmdMesh(size, xs.Mesh(np.arange(size), (size,), (AXIS,)), limits)


def sharding_of(tensor: torch.Tensor) -> str:
    """The sharding XLA holds for a tensor, e.g. ``{devices=[1,2]0,1}``; '' = replicated."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def chip_limits(size: int) -> list[int]:
    """Each chip's memory limit in bytes, read before SPMD starts (PJRT's per-device
    statistics; the SPMD virtual device has none)."""
    import torch_xla.core.xla_model as xm

    return [int(xm.get_memory_info(f"xla:{i}")["bytes_limit"]) for i in range(size)]
