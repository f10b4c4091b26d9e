"""Linear layers of decode-sized batches on CUDA: a split-K matrix product in Triton.

A decode step multiplies a few rows (one per request) by each weight matrix, so the product is
bound by streaming the weights from memory. With 64 rows or fewer, one tile of rows covers the
whole batch, and a library GEMM then has only ``out / tile_width`` tiles to spread over the
GPU: for a 4096-wide output that is 32 to 64 thread blocks on a 132-multiprocessor H200, too
few to keep enough loads in flight (measured 1.4 to 1.6 TB/s for 4096 x 4096 and 4096 x 6144
bf16 weights at 64 rows, against 4.2 TB/s for a device copy).

Here each program streams a ``[K / split, 64]`` panel of the weight and multiplies it with the
batch's rows; ``split`` is chosen so that the grid has at least two programs per
multiprocessor. With a split, each program writes its float32 partial sums to a workspace and a
second kernel adds the ``split`` partials in a fixed order (deterministic: the same inputs give
the same bits, whatever the timing), adds the bias and rounds once to the model's dtype.

Used for bf16/fp16 weights in the model's ``[in, out]`` layout; anything else (float32 models,
more rows, shapes off the tiles) goes to cuBLAS.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

#: Most rows the split-K kernel takes (one row tile); larger batches fill the GPU with cuBLAS.
MAX_ROWS = 64
BLOCK_N = 64  # output columns per program (128 bytes of a bf16 weight row: one cache line)
BLOCK_K = 128  # weight rows per loop iteration


@triton.jit
def _split_k_kernel(x_ptr, w_ptr, out_ptr, ws_ptr, bias_ptr, rows, n, x_stride, w_stride,
                    out_stride, K_PER_SPLIT: tl.constexpr, SPLIT: tl.constexpr,
                    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    m_ok = rm < rows
    x_ptrs = x_ptr + rm[:, None] * x_stride + rk[None, :]
    w_ptrs = w_ptr + rk[:, None].to(tl.int64) * w_stride + rn[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
        w = tl.load(w_ptrs)
        acc = tl.dot(x, w, acc)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[None, :]
        tl.store(out_ptr + rm[:, None] * out_stride + rn[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:  # partial sums: workspace [SPLIT, BLOCK_M, n]
        tl.store(ws_ptr + (pid_k * BLOCK_M + rm)[:, None] * n + rn[None, :], acc,
                 mask=m_ok[:, None])


@triton.jit
def _sum_splits_kernel(ws_ptr, bias_ptr, out_ptr, n, out_stride, SPLIT: tl.constexpr,
                       BLOCK_M: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < n
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: deterministic sums
        acc += tl.load(ws_ptr + (s * BLOCK_M + row) * n + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=ok)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 132  # (Triton's interpreter on the CPU: pretend an H200)
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_for(k: int, n: int, device: torch.device) -> int:
    """Splits of the K axis: the fewest (1, 2, 4, 8) giving two programs per multiprocessor,
    each split a whole number of BLOCK_K rows."""
    want = 2 * _multiprocessors(device)
    split = 1
    while (n // BLOCK_N) * split < want and split < 8 and k % (2 * split * BLOCK_K) == 0:
        split *= 2
    return split


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether ``x @ weight`` takes the split-K kernel (else cuBLAS)."""
    return (x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and 0 < x.shape[0] <= MAX_ROWS and x.dim() == 2 and x.stride(1) == 1
            and weight.dim() == 2 and weight.stride(1) == 1
            and weight.shape[0] % BLOCK_K == 0 and weight.shape[1] % BLOCK_N == 0)


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   split: int = 0) -> torch.Tensor:
    """``x [M, K] @ weight [K, N] (+ bias)`` for M <= MAX_ROWS, rounded once to x's dtype;
    ``split`` (0 = ``split_for``'s choice) must divide K into whole BLOCK_K tiles."""
    rows = x.shape[0]
    k, n = weight.shape
    split = split or split_for(k, n, x.device)
    block_m = max(16, triton.next_power_of_2(rows))
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    ws = out if split == 1 else torch.empty(split, block_m, n, dtype=torch.float32,
                                            device=x.device)
    b = bias if bias is not None else out
    _split_k_kernel[(n // BLOCK_N, split)](
        x, weight, out, ws, b, rows, n, x.stride(0), weight.stride(0), out.stride(0),
        K_PER_SPLIT=k // split, SPLIT=split, HAS_BIAS=bias is not None, BLOCK_M=block_m,
        BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4, num_stages=4)
    if split > 1:
        block = 1024
        _sum_splits_kernel[(rows, triton.cdiv(n, block))](
            ws, b, out, n, out.stride(0), SPLIT=split, BLOCK_M=block_m,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return out
