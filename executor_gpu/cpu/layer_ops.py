"""The fused CPU layer ops (layer_ops.cpp) as a ``LayerOps`` for float32 and bfloat16 models.

Each elementwise op is one pass over its rows (RMSNorm with the residual add folded in, RoPE in
place on the query and key heads, SiLU-and-multiply) instead of several eager torch operators
(layer_ops.cpp); linear layers run over weights packed into column panels
(packed_linear.cpp). In bfloat16 the kernels read and write bf16 and compute in float32,
rounding where the reference rounds. ``layer_ops`` returns None where the kernels cannot be
built.
"""

from __future__ import annotations

import torch

from common.torch.models.layer_ops import TORCH_LAYER_OPS, LayerOps, torch_logits
from executor_gpu.cpu.kernels import bf16_dot_enabled, load_kernels


def layer_ops_of(module, bf16_dot: bool | None = None) -> LayerOps:
    """A ``LayerOps`` over the built kernels (float32 or bfloat16 models). ``bf16_dot``: bf16
    weights packed for the AVX-512 bf16 dot products (default: ``bf16_dot_enabled``)."""
    rotary_ = module.rotary_
    packed_linear, panel = module.packed_linear, module.PANEL
    if bf16_dot is None:
        bf16_dot = bf16_dot_enabled(module)

    def pack(weight: torch.Tensor) -> torch.Tensor:  # [in, out] -> panels (3-D, or 4-D pairs)
        pairs = bf16_dot and weight.dtype == torch.bfloat16 and weight.shape[0] % 2 == 0
        return module.pack_linear_weight(weight, pairs)

    def prepare_linear(weight: torch.Tensor) -> torch.Tensor:
        return pack(weight) if weight.shape[1] % panel == 0 else weight

    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if weight.dim() > 2:  # packed
            return packed_linear(x, weight, bias)
        return TORCH_LAYER_OPS.linear(x, weight, bias)

    def prepare_logits(embedding: torch.Tensor) -> torch.Tensor:
        # [vocab, hidden] -> the panels of its transpose (a copy beside tied input embeddings)
        return pack(embedding.t()) if embedding.shape[0] % panel == 0 else embedding

    def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        if weight.dim() > 2:  # packed
            return packed_linear(hidden, weight, None).float()  # no copy in float32
        return torch_logits(hidden, weight)

    def rope_for_step(
        table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return table, positions  # the kernel indexes the table itself

    def rotary(x: torch.Tensor, n: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        rotary_(x, n, rope[1], rope[0])
        return x[:, :n]

    return LayerOps(
        "cpu_fused",
        prepare_linear,
        linear,
        module.rms_norm,
        module.add_rms_norm_,
        rope_for_step,
        rotary,
        module.silu_and_mul,
        prepare_logits,
        logits,
    )


def layer_ops(bf16_dot: bool | None = None) -> LayerOps | None:
    """The fused CPU layer ops, or None without the built kernels."""
    module = load_kernels()
    return None if module is None else layer_ops_of(module, bf16_dot)
