"""Compile every Triton kernel of executor_gpu for an H100/H200 (sm_90) without a GPU.

Triton's interpreter (tests/executor_gpu/cuda/test_triton_kernels.py) checks what the kernels
compute, but not that the compiler accepts them: type rules such as "a loop-carried variable
keeps its type" are only enforced when compiling. Compilation down to a cubin needs no GPU, only
Triton's bundled toolchain, so this runs anywhere. Run as a script (the test process interprets
kernels):

    TRITON_INTERPRET=0 python tests/executor_gpu/cuda/triton_compile_check.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(
    0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from executor_gpu.cuda import triton_attention, triton_layer_ops, triton_prefill  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


def _compile(
    kernel, types: dict[str, str], constexprs: dict, num_warps: int = 4, num_stages: int = 3
):
    """Compile ``kernel`` with every argument typed (``types`` names pointer and float args; the
    rest are i32 scalars or constexprs); returns the compiled kernel."""
    signature = {}
    for name in kernel.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        else:
            signature[name] = types.get(name, "i32")
    src = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    options = {"num_warps": num_warps, "num_stages": num_stages}
    return triton.compile(src, target=TARGET, options=options)


def _compile_prefill(dtype: str, precision: str) -> None:
    """The prefill kernel at the tiles it launches with on CUDA, paged and not, with and
    without soft-capping or a window, for the head sizes served."""
    ptrs = {n: f"*{dtype}" for n in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")}
    ptrs.update(
        tables_ptr="*i64", seq_lens_ptr="*i64", qsl_ptr="*i64", scale="fp32", softcap="fp32"
    )
    size = 2 if dtype == "bf16" else 4
    cuda = torch.device("cuda")
    for paged, softcap, window, head_dim in (
        (True, False, False, 128),
        (False, False, False, 128),
        (True, True, False, 128),
        (True, False, True, 128),
        (True, False, False, 64),
        (True, False, False, 80),
        (True, False, False, 256),
    ):
        dim_pad = triton.next_power_of_2(head_dim)
        launches = triton_prefill.launch_settings(dim_pad, size, cuda)
        if softcap or window or not paged or head_dim not in (128, 256):
            launches = launches[:1]  # (every setting of the table for the plain paged kernel)
        for rank, (block_m, block_n, warps, stages) in enumerate(launches):
            kernel = _compile(
                triton_prefill._paged_prefill_kernel,
                ptrs,
                dict(
                    GROUP=4,
                    HEAD_DIM=head_dim,
                    DIM_PAD=dim_pad,
                    BLOCK_M=block_m,
                    BLOCK_N=block_n,
                    BLOCK_SIZE=16 if paged else 1,
                    PRECISION=precision,
                    PAGED=paged,
                    SOFTCAP=softcap,
                    DOT_F32=False,
                    PIPELINED=True,
                    WINDOW=window,
                    LONGEST_FIRST=triton_prefill.LONGEST_FIRST,
                ),
                num_warps=warps,
                num_stages=stages,
            )
            # The first setting within an H100/H200's 227 KiB; the others in less.
            limit = 227 * 1024 if rank == 0 else 160 * 1024
            assert kernel.metadata.shared <= limit, (head_dim, block_m, kernel.metadata.shared)


def main() -> None:
    for dtype, precision in (("bf16", "tf32"), ("fp32", "ieee")):
        ptrs = {n: f"*{dtype}" for n in ("out_ptr", "q_ptr", "cache_ptr", "k_new_ptr", "v_new_ptr")}
        ptrs.update(
            tables_ptr="*i64",
            seq_lens_ptr="*i64",
            slots_ptr="*i64",
            scale="fp32",
            part_m_ptr="*fp32",
            part_l_ptr="*fp32",
            part_acc_ptr="*fp32",
        )
        for store, parts, head_dim in (
            (False, 1, 128),
            (True, 1, 128),
            (True, 8, 128),
            (True, 1, 64),
            (True, 1, 80),
            (True, 1, 256),
        ):
            kernel = _compile(
                triton_attention._paged_decode_kernel,
                ptrs,
                dict(
                    GROUP=4,
                    GROUP_PAD=16,
                    HEAD_DIM=head_dim,
                    DIM_PAD=triton.next_power_of_2(head_dim),
                    TILE_TOKENS=triton_attention.tile_for(
                        triton.next_power_of_2(head_dim), 2 if dtype == "bf16" else 4
                    ),
                    PRECISION=precision,
                    STORE_KV=store,
                    PARTS=parts,
                    SOFTCAP=False,
                    BLOCK_SIZE=16,
                ),
            )
            # Within the shared memory a block may have on an H100/H200 (227 KiB).
            assert kernel.metadata.shared <= 227 * 1024, (head_dim, kernel.metadata.shared)
        _compile(
            triton_attention._combine_parts_kernel,
            {
                "out_ptr": f"*{dtype}",
                "part_m_ptr": "*fp32",
                "part_l_ptr": "*fp32",
                "part_acc_ptr": "*fp32",
            },
            dict(HEAD_DIM=128, DIM_PAD=128, PARTS=8),
        )
        _compile_prefill(dtype, precision)
        for residual in (False, True):
            _compile(
                triton_layer_ops._rms_norm_kernel,
                {n: f"*{dtype}" for n in ("out_ptr", "x_ptr", "res_ptr", "w_ptr")}
                | {"eps": "fp32"},
                dict(HAS_RESIDUAL=residual, BLOCK=4096),
                num_warps=16,
            )
        _compile(
            triton_layer_ops._rotary_kernel,
            {"x_ptr": f"*{dtype}", "table_ptr": "*fp32", "pos_ptr": "*i64"},
            dict(HALF=64, HALF_PAD=64, HEADS_PAD=64),
        )
        _compile(
            triton_layer_ops._silu_and_mul_kernel,
            {"out_ptr": f"*{dtype}", "x_ptr": f"*{dtype}"},
            dict(BLOCK=1024),
        )
    print("all kernels compiled for sm_90")


if __name__ == "__main__":
    main()
