"""The model's per-layer math outside attention as a swappable set of functions.

Everything in a decoder layer but attention (the linear layers, RMSNorm with the residual add,
rotary embedding, SiLU-and-multiply) goes through a ``LayerOps``. ``TORCH_LAYER_OPS`` is the
plain torch implementation every device can run; a device package can build a fused set (one
pass per op instead of several eager operators) and hand it to
``LlamaForCausalLM.set_layer_ops``. Implementations must compute the same math: the torch set
is the reference the fused ones are tested against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class LayerOps:
    """One implementation of the per-layer elementwise ops."""

    name: str  # for logs and tests
    # [in, out] weight -> the layout ``linear`` takes (applied once, when the ops are set)
    prepare_linear: Callable[[torch.Tensor], torch.Tensor]
    # (x [T, in], prepared weight, bias [out] or None) -> x @ weight + bias
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (x [T, H], weight [H], eps) -> RMSNorm(x) * weight
    rms_norm: Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (x, residual, weight, eps) -> RMSNorm(residual + x) * weight; residual becomes
    # residual + x in place
    add_rms_norm: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
    # (cos|sin table [P, d], positions [T], dtype) -> the step's rotation, shared by layers
    rope_for_step: Callable[[torch.Tensor, torch.Tensor, torch.dtype], Any]
    # (x [T, heads, d], n, rotation) -> the first n heads rotated, [T, n, d] (may alias x)
    rotary: Callable[[torch.Tensor, int, Any], torch.Tensor]
    # gate|up [T, 2I] -> silu(gate) * up [T, I]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # output embedding [vocab, hidden] -> the form ``logits`` takes (once, when the ops are set)
    prepare_logits: Callable[[torch.Tensor], torch.Tensor]
    # (hidden [S, H], prepared output embedding) -> float32 logits [S, vocab]
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.mm(x, weight) if bias is None else torch.addmm(bias, x, weight)


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back before the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)  # same math, one call
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _torch_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    residual.add_(x)
    return torch_rms_norm(residual, weight, eps)


def _torch_rope_for_step(
    table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin [T, 1, d] of the tokens' positions (looked up once per step)."""
    half = table.shape[-1] // 2
    rows = table[positions].to(dtype)  # [T, d]
    cos = rows[:, None, :half].repeat(1, 1, 2)
    sin = rows[:, None, half:]
    return cos, torch.cat([-sin, sin], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, heads, d] by per-token cos / signed sin [T, 1, d] (half-split convention):
    ``x * cos + (x2, x1) * (-sin, sin)``, i.e. the usual ``x * cos + rotate_half(x) * sin``."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


def _torch_rotary(x: torch.Tensor, n: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return apply_rotary(x[:, :n], *rope)


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits of hidden rows against the [vocab, hidden] output embedding."""
    # W [V, H] @ hidden^T, transposed back: avoids a GEMM with a transposed [V, H] operand,
    # which some BLAS libraries run slowly for few rows.
    return torch.mm(weight, hidden.t()).t().float().contiguous()


TORCH_LAYER_OPS = LayerOps(
    "torch",
    lambda weight: weight,
    _torch_linear,
    torch_rms_norm,
    _torch_add_rms_norm,
    _torch_rope_for_step,
    _torch_rotary,
    _torch_silu_and_mul,
    lambda weight: weight,
    torch_logits,
)
