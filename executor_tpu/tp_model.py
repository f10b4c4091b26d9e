"""A served model sharded over an SPMD mesh (Megatron-style tensor parallelism, by annotation).

``shard_model`` prepares a loaded model (still on the host) for ``SpmdMesh`` and moves it:

1. regroups the fused projections so that each device's column tile holds whole heads / units
   (``executor_tpu.head_groups``), pads the row-parallel weights to match, and switches the
   attention and MLP modules to forwards that read the regrouped layout (``HeadGroupedAttention``,
   ``DeviceGroupedOutput`` / ``DeviceGroupedInput``);
2. moves each parameter to the device and annotates it (``param_spec``): column-parallel
   ``qkv_proj`` / ``gate_up_proj`` split their columns, row-parallel ``o_proj`` / ``down_proj``
   their rows, the embedding and ``lm_head`` their vocabulary rows; norms and the router stay
   replicated. MoE expert stacks split their units evenly (not regrouped: GSPMD moves the
   ``gate | up`` halves between devices).

So each decoder layer computes on its own heads and units and communicates twice (the sums of
``o_proj`` and ``down_proj``, an all-reduce of [T, hidden] each); XLA inserts them. The KV cache
(``kv_spec``) is split over its heads axis the same way, whole heads per device.

The model classes are not modified: modules whose math is not the plain Llama attention / gated
MLP forward keep their layout and are split evenly (GSPMD stays correct, with more traffic).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn

from common.torch.models.llama import Linear, LlamaAttention
from executor_tpu.head_groups import HeadGroups, UnitGroups, take
from executor_tpu.spmd import AXIS, Spec, SpmdMesh

log = logging.getLogger(__name__)

#: Column-parallel (split output columns) and row-parallel (split input rows) linear layers.
COLUMN_PARALLEL = ("qkv_proj", "gate_up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")
#: Weights [vocab, hidden] split over the vocabulary.
VOCAB_PARALLEL = ("embed_tokens", "lm_head")
#: KV cache [blocks, block_size, 2 * kv_heads, head_dim] (heads interleaved k, v): split heads.
KV_SPEC: Spec = (None, None, AXIS, None)


def param_spec(name: str, ndim: int) -> Spec:
    """A parameter's partition spec, from its name (``model.layers.0.mlp.down_proj.weight``)."""
    parts = name.split(".")
    module, attr = (parts[-2] if len(parts) > 1 else ""), parts[-1]
    if module in COLUMN_PARALLEL:
        return (None, AXIS) if attr == "weight" else (AXIS,)
    if module in ROW_PARALLEL and attr == "weight":
        return (AXIS, None)
    if module in VOCAB_PARALLEL and attr == "weight":
        return (AXIS, None)
    if attr == "w_gate_up":  # MoE experts [E, hidden, 2 * units]
        return (None, None, AXIS)
    if attr == "w_down":  # [E, units, hidden]
        return (None, AXIS, None)
    return (None,) * ndim


class HeadGroupedAttention:
    """Mixin over a Llama-family attention class: the forward over a ``qkv_proj`` regrouped by
    device (``HeadGroups.qkv_columns``) and a zero-padded ``o_proj``. Same math as
    ``LlamaAttention.forward`` on the padded heads (padded heads are zero and add zero)."""

    head_groups: HeadGroups  # set by regroup_attention
    tp_mesh: SpmdMesh  # to constrain the heads to their devices

    def forward(self: Any, rope: Any, x: torch.Tensor, meta: Any) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden], each device on its own heads."""
        g, mesh, t, d = self.head_groups, self.tp_mesh, x.shape[0], self.head_dim
        ql, kl = g.local_heads, g.local_kv_heads
        qkv = self.qkv_proj(x).view(t, g.size, ql + 2 * kl, d)
        q = mesh.heads(qkv[:, :, :ql].reshape(t, g.padded_heads, d))
        k = mesh.heads(qkv[:, :, ql : ql + kl].reshape(t, g.padded_kv_heads, d))
        v = mesh.heads(qkv[:, :, ql + kl :].reshape(t, g.padded_kv_heads, d))
        if self.q_norm is not None and self.k_norm is not None:
            # Normed over the last axis as [T, heads, d] (norm_heads flattens [T * heads, d],
            # which would gather the heads split over the devices).
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotated apart (not as one q|k block): per head, the same math.
        q = self.ops.rotary(q, g.padded_heads, rope)
        k = self.ops.rotary(k, g.padded_kv_heads, rope)
        out = self.backend(
            q, k, v, self.kv_cache, meta, self.scale, window=self.window, softcap=self.softcap
        )
        # The updated cache leaves the program split as it came in: an output sharding of
        # XLA's choosing would be a new input sharding next step, hence a new program.
        mesh.shard(self.kv_cache, KV_SPEC)
        return self.o_proj(mesh.heads(out).reshape(t, g.padded_heads * d))


@functools.cache
def _grouped_class(cls: type) -> type:
    return type(f"HeadGrouped{cls.__name__}", (HeadGroupedAttention, cls), {})


class DeviceGroupedOutput(Linear):
    """A column-parallel Linear whose output is viewed per device: [T, devices, cols / devices]
    (a gated MLP's ``chunk(2, -1)`` then splits each device's ``gate | up`` locally)."""

    tp_size: int  # devices

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, devices, out / devices]."""
        return super().forward(x).view(x.shape[0], self.tp_size, -1)


class DeviceGroupedInput(Linear):
    """A row-parallel Linear taking the per-device view [T, devices, units / devices]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, devices, in / devices] -> [T, out]."""
        return super().forward(x.reshape(x.shape[0], -1))


def regroup_attention(attn: LlamaAttention, mesh: SpmdMesh, kv_per_device: int = 0) -> HeadGroups:
    """Reorder ``qkv_proj``'s columns by device, pad ``o_proj``'s rows, switch the forward;
    ``kv_per_device`` as in HeadGroups (the KV layout's heads per device)."""
    groups = HeadGroups(mesh.size, attn.num_heads, attn.num_kv_heads, attn.head_dim, kv_per_device)
    _reindex(attn.qkv_proj, groups.qkv_columns(), dim=1)
    _reindex(attn.o_proj, groups.o_rows(), dim=0)
    attn.__class__ = _grouped_class(type(attn))
    attn.head_groups, attn.tp_mesh = groups, mesh
    return groups


def regroup_mlp(mlp: nn.Module, size: int) -> bool:
    """Reorder a gated MLP's ``gate | up`` columns by device and switch its projections to the
    per-device view; False (untouched) for a block that is not such an MLP."""
    gate_up, down = getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)
    if type(gate_up) is not Linear or type(down) is not Linear:
        return False
    units = gate_up.shard_sizes[0]
    if gate_up.shard_sizes != [units, units]:
        return False
    groups = UnitGroups(size, units)
    _reindex(gate_up, groups.gate_up_columns(), dim=1)
    _reindex(down, groups.down_rows(), dim=0)
    gate_up.__class__, down.__class__ = DeviceGroupedOutput, DeviceGroupedInput
    gate_up.tp_size = size
    return True


def _reindex(linear: Linear, index: list[int], dim: int) -> None:
    """Reindex a Linear's weight along ``dim`` (0 = input rows, 1 = output columns) and, for
    columns, its bias."""
    linear.weight.data = take(linear.weight.data, index, dim)
    if dim == 1:
        linear.shard_sizes = [len(index)]
        if linear.bias is not None:
            linear.bias.data = take(linear.bias.data, index, 0)


def shard_model(
    model: nn.Module, mesh: SpmdMesh, device: torch.device, kv_per_device: int = 0
) -> int:
    """Regroup (on the host), move and annotate every parameter; returns the bytes of weights
    one device holds. ``kv_per_device``: the KV layout's heads per device (0 = the fewest)."""
    groups = None
    for layer in model.model.layers:
        groups = regroup_attention(layer.self_attn, mesh, kv_per_device)
        regroup_mlp(layer.mlp, mesh.size)
    assert groups is not None, "a model without layers"
    per_device = 0
    moved: dict[int, nn.Parameter] = {}  # by the host parameter's id: tied weights move once
    for prefix, module in model.named_modules():
        for attr, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in moved:
                spec = param_spec(f"{prefix}.{attr}" if prefix else attr, param.dim())
                # One tensor at a time: a device holds at most one whole weight beyond its
                # shards. (An XLA tensor cannot replace a host parameter's data in place.)
                data = mesh.shard(param.data.to(device), spec)
                moved[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
                share = mesh.size if AXIS in spec else 1
                per_device += -(-param.numel() // share) * param.element_size()
            module._parameters[attr] = moved[id(param)]
    model.to(device)  # the buffers (RoPE table), replicated
    log.info(
        "sharded over %d devices: %d query / %d KV heads per device (%d / %d of them padding), "
        "%.1f MiB of weights per device",
        mesh.size,
        groups.local_heads,
        groups.local_kv_heads,
        groups.padded_heads - groups.num_heads,
        groups.padded_kv_heads - groups.num_kv_heads,
        per_device / 2**20,
    )
    return per_device
