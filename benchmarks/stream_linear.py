"""A candidate for decode-sized linear layers on CUDA: a weight-streaming product in Triton.

Measured against cuBLAS by benchmarks/gpu_linear.py and slower at every Llama-3-8B shape on an
H200 (benchmarks/README.md), so the executor keeps cuBLAS; the kernel stays here so that the
comparison can be rerun on other GPUs and Triton versions.

A decode step multiplies a few rows (one per request, at most 64 here) by every weight matrix,
so each product is bound by reading the weight once from memory. cuBLAS tiles the output in
64-column tiles for such shapes: a 6144-wide q/k/v product is 96 thread blocks and a 4096-wide
one 64 to 128, on a GPU of 132 multiprocessors, and an H200 replay measured them at 2.9-3.0
TB/s against 4.2 TB/s for a copy (benchmarks/README.md).

Here a program computes ``BLOCK_N`` output columns for all rows over ``1 / SPLIT`` of the
reduction axis, so the grid has ``n / BLOCK_N * SPLIT`` programs: narrow tiles and splits
spread the weight over every multiprocessor. The weight may be stored [in, out] (the model's
layout) or [out, in] (each output column's weights contiguous: long runs per load); strides
say which. With ``SPLIT > 1`` the programs write float32 partial sums and a second kernel adds
them in a fixed order (deterministic: the same inputs give the same bits), adds the bias and
rounds once to the output's dtype.

Every kernel also runs under Triton's interpreter (``TRITON_INTERPRET=1``) on CPU tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

#: Most rows one program's tile holds (a decode batch); more go to cuBLAS.
MAX_ROWS = 64


@dataclass(frozen=True)
class LinearTiles:
    """Launch settings of ``stream_linear``."""

    block_n: int  # output columns per program
    block_k: int  # weight rows (reduction axis) per loop iteration
    split: int  # parts of the reduction axis, each a program (1 = no partial sums)
    warps: int  # num_warps of the product kernel
    stages: int  # software-pipelining stages of its loop


@triton.jit
def _stream_linear_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    bias_ptr,
    rows,
    n,
    x_stride,
    w_stride_k,
    w_stride_n,
    out_stride,
    K_PER_SPLIT: tl.constexpr,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = rm < rows
    x_ptrs = x_ptr + rm[:, None] * x_stride + rk[None, :]
    w_ptrs = w_ptr + rk[:, None].to(tl.int64) * w_stride_k + rn[None, :].to(tl.int64) * w_stride_n
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        out = out_ptr + rm[:, None] * out_stride + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:  # partial sums [SPLIT, rows, n]
        part = part_ptr + (pid_k * rows + rm)[:, None].to(tl.int64) * n + rn[None, :]
        tl.store(part, acc, mask=m_ok[:, None])


@triton.jit
def _sum_parts_kernel(
    part_ptr,
    bias_ptr,
    out_ptr,
    rows,
    n,
    out_stride,
    SPLIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: deterministic sums
        acc += tl.load(part_ptr + (s * rows + row).to(tl.int64) * n + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


def fits(x: torch.Tensor, weight_in_out: torch.Tensor, tiles: LinearTiles) -> bool:
    """Whether ``stream_linear`` takes ``x @ weight`` with ``tiles``: at most MAX_ROWS rows,
    a contiguous last axis for x, and a weight whose shape divides into whole tiles.
    ``weight_in_out`` is the [in, out] view (a transposed [out, in] tensor is fine)."""
    k, n = weight_in_out.shape
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.stride(1) == 1
        and x.shape[1] == k
        and n % tiles.block_n == 0
        and k % (tiles.split * tiles.block_k) == 0
    )


def stream_linear(
    x: torch.Tensor, weight_in_out: torch.Tensor, bias: torch.Tensor | None, tiles: LinearTiles
) -> torch.Tensor:
    """``x [M, K] @ weight_in_out [K, N] (+ bias)``, rounded once to x's dtype, for shapes
    ``fits`` accepts. ``weight_in_out`` may be any strided [K, N] view: the [in, out] tensor
    or the transpose of an [out, in] one."""
    rows = x.shape[0]
    k, n = weight_in_out.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    parts = out
    if tiles.split > 1:
        parts = torch.empty(tiles.split, rows, n, dtype=torch.float32, device=x.device)
    b = bias if bias is not None else out
    _stream_linear_kernel[(n // tiles.block_n, tiles.split)](
        x,
        weight_in_out,
        out,
        parts,
        b,
        rows,
        n,
        x.stride(0),
        weight_in_out.stride(0),
        weight_in_out.stride(1),
        out.stride(0),
        K_PER_SPLIT=k // tiles.split,
        SPLIT=tiles.split,
        HAS_BIAS=bias is not None,
        BLOCK_M=max(16, triton.next_power_of_2(rows)),
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    if tiles.split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _sum_parts_kernel[(rows, triton.cdiv(n, block))](
            parts,
            b,
            out,
            rows,
            n,
            out.stride(0),
            SPLIT=tiles.split,
            HAS_BIAS=bias is not None,
            BLOCK=block,
            num_warps=4,
        )
    return out
