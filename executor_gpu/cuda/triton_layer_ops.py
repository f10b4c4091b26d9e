"""Fused layer ops for CUDA, in Triton, as a ``LayerOps`` ("cuda_fused").

Each elementwise op is one kernel instead of the 3 to 8 eager operators of the torch set:
RMSNorm (with the residual add folded in, the residual updated in place), RoPE in place on the
query and key heads (reading the cos|sin table by position, so no per-step table gather), and
SiLU-and-multiply. The arithmetic is done in float32 and rounded once to the model's dtype.
Linear layers and the logits stay on cuBLAS: Triton products for decode-sized batches (split-K,
and a sweep of tiles and splits in benchmarks/gpu_linear.py) were measured slower than cuBLAS on
an H200 (benchmarks/README.md); the logits are cuBLAS's product in its own layout. A decode
step of a 32-layer model is then 9 launches per layer, which CUDA graphs replay with no host
work.

The kernels also run under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.torch.models.layer_ops import TORCH_LAYER_OPS, LayerOps


@triton.jit
def _rms_norm_kernel(
    out_ptr,
    x_ptr,
    res_ptr,
    w_ptr,
    hidden,
    eps,
    x_stride,
    res_stride,
    out_stride,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < hidden
    x = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        res = res_ptr + row * res_stride + cols
        total = (x + tl.load(res, mask=ok, other=0.0).to(tl.float32)).to(res_ptr.dtype.element_ty)
        tl.store(res, total, mask=ok)
        x = total.to(tl.float32)  # the norm reads the stored (rounded) residual
    inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / hidden + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    # Normalized value rounded to the model's dtype, then scaled (the reference's order).
    y = (x * inv_rms).to(w.dtype).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _rotary_kernel(
    x_ptr,
    table_ptr,
    pos_ptr,
    num_heads,
    x_stride_t,
    x_stride_h,
    table_stride,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    HEADS_PAD: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + tok)
    i = tl.arange(0, HALF_PAD)
    i_ok = i < HALF
    cos = tl.load(table_ptr + pos * table_stride + i, mask=i_ok, other=0.0)
    sin = tl.load(table_ptr + pos * table_stride + HALF + i, mask=i_ok, other=0.0)
    h = tl.arange(0, HEADS_PAD)
    mask = (h < num_heads)[:, None] & i_ok[None, :]
    first = x_ptr + tok * x_stride_t + h[:, None] * x_stride_h + i[None, :]
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(first, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(first + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_and_mul_kernel(out_ptr, x_ptr, inter, x_stride, out_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(x_ptr + row * x_stride + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * x_stride + inter + cols, mask=ok, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * out_stride + cols, y.to(out_ptr.dtype.element_ty), mask=ok)


def _norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0]:
        block = triton.next_power_of_2(x.shape[1])
        res = x if residual is None else residual
        _rms_norm_kernel[(x.shape[0],)](
            out,
            x,
            res,
            weight,
            x.shape[1],
            eps,
            x.stride(0),
            res.stride(0),
            out.stride(0),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=max(1, min(16, block // 256)),
        )
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm(x) * weight over the last axis of x [T, H] (unit last stride)."""
    return _norm(x, None, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMSNorm(residual + x) * weight; residual becomes residual + x in place."""
    return _norm(x, residual, weight, eps)


def rope_for_step(
    table: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel indexes the float32 cos|sin table itself. Positions are not range-checked
    here: the input batch rejects sequences past the model's length, which the table covers."""
    return table, positions


def rotary(x: torch.Tensor, n: int, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate the first n heads of x [T, heads, d] in place; returns that [T, n, d] view."""
    table, positions = rope
    if x.shape[0]:
        half = x.shape[2] // 2
        _rotary_kernel[(x.shape[0],)](
            x,
            table,
            positions,
            n,
            x.stride(0),
            x.stride(1),
            table.stride(0),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            HEADS_PAD=triton.next_power_of_2(n),
            num_warps=4,
        )
    return x[:, :n]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate|up [T, 2I] -> silu(gate) * up [T, I]."""
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_and_mul_kernel[(rows, triton.cdiv(inter, block))](
            out, gate_up, inter, gate_up.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Float32 logits of hidden rows against the [vocab, hidden] output embedding, rounded to
    the model's dtype first (as the torch set). cuBLAS's own layout (``hidden @ weight^T``)
    writes the rows in order, so the cast to float32 is one contiguous pass; the torch set's
    ``(weight @ hidden^T)^T`` (for CPU libraries) costs a strided cast and a copy on CUDA, 84 us
    of a 5.5 ms batch-64 replay on an H200."""
    return torch.nn.functional.linear(hidden, weight).float()


#: The CUDA set: Triton elementwise kernels; cuBLAS for the linear layers and the logits.
CUDA_LAYER_OPS = LayerOps(
    "cuda_fused",
    TORCH_LAYER_OPS.prepare_linear,
    TORCH_LAYER_OPS.linear,
    rms_norm,
    add_rms_norm,
    rope_for_step,
    rotary,
    silu_and_mul,
    TORCH_LAYER_OPS.prepare_logits,
    logits,
)
