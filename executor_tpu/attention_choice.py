"""Which attention path and KV layout a TPU runner uses, from its options and device."""

from __future__ import annotations

import importlib.util
import logging

import torch
import torch_xla.core.xla_model as xm

from common.wire.config import ModelGeometry
from executor_tpu.attention import KVLayout, kernel_layout, plain_layout
from executor_tpu.spmd import SpmdMesh

log = logging.getLogger(__name__)


def is_tpu(device: torch.device) -> bool:
    """Whether an XLA device is a TPU."""
    return xm.xla_device_hw(device) == "TPU"


def kernel_available() -> bool:
    """Whether the ragged paged attention kernel can be built (it is traced with JAX/Pallas:
    torch_xla's ``pallas`` extra)."""
    if importlib.util.find_spec("jax") is not None:
        return True
    log.warning(
        "jax is not installed (pip install 'torch_xla[tpu,pallas]==2.9.0'): the TPU "
        "runs the static gather attention instead of the ragged paged kernel"
    )
    return False


def choose_attention(option: str, device: torch.device) -> str:
    """``ragged`` (the kernel) or ``gather``: auto = the kernel on a TPU with JAX."""
    if option == "auto":
        return "ragged" if is_tpu(device) and kernel_available() else "gather"
    return option


def choose_layout(
    attention: str,
    option: str,
    geometry: ModelGeometry,
    kv_bytes: int,
    mesh: SpmdMesh | None,
) -> KVLayout:
    """The KV layout: padded for the kernel (``--kv-layout``, auto = when the kernel is used);
    sharded, whole KV heads per device, as many on each (see executor_tpu.head_groups)."""
    heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    padded = option == "padded" or (option == "auto" and attention == "ragged")
    if mesh is None:
        return kernel_layout(heads, head_dim, kv_bytes) if padded else plain_layout(heads, head_dim)
    # Sharded: each device's heads must suit the kernel on their own (it runs per device); the
    # padding heads are part of the regrouped model (zero heads), not of the layout.
    local = -(-heads // mesh.size)
    if not padded:
        return plain_layout(local * mesh.size, head_dim)
    kernel = kernel_layout(local, head_dim, kv_bytes)
    total = kernel.padded_kv_heads * mesh.size
    return KVLayout(total, head_dim, total, kernel.padded_head_dim)
