"""The CUDA executor's Triton kernels against the torch reference, under Triton's interpreter.

``TRITON_INTERPRET=1`` makes ``triton.jit`` return interpreted kernels that run on CPU tensors,
so this checks the kernels' indexing and arithmetic on machines without a GPU (the CUDA build of
the same kernels is checked by benchmarks/gpu_step.py on a GPU). The flag must be set before
triton is first imported (its own library functions are kernels too): tests/conftest.py sets it.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.torch.attention import _decode_attention, torch_paged_attention
from common.torch.models.layer_ops import TORCH_LAYER_OPS

triton = pytest.importorskip("triton")


if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it before triton loads
    pytest.skip(
        "TRITON_INTERPRET=1 was not set before triton was imported", allow_module_level=True
    )

from executor_gpu.cuda import triton_attention as attn  # noqa: E402
from executor_gpu.cuda import triton_layer_ops as ops  # noqa: E402
from tests.executor_gpu.paged_cases import decode_meta, last_token_slots, mixed_meta  # noqa: E402


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [
        (8, 2, 64, 16),  # GQA group of 4
        (6, 2, 80, 16),  # group of 3 and a head size that is not a power of two (padded)
        (4, 4, 32, 8),  # no grouping; a block size smaller than the tile
        (4, 1, 16, 48),  # a block size larger than the tile, not a power of two
    ],
)
@pytest.mark.parametrize("lens", [[1], [5, 33, 32, 70], [100, 1, 64]])
def test_decode_attention_matches_reference(heads, kv_heads, dim, block_size, lens):
    torch.manual_seed(sum(lens) + heads)
    num_blocks = 64
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    meta = decode_meta(lens, block_size, num_blocks, seed=heads, extra_columns=3)
    # Queries as a strided view of a fused q|k|v tensor, as the model passes them.
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim)
    q = qkv[:, :heads]
    expected = _decode_attention(q, kv, meta, dim**-0.5)
    for parts in (0, 1, 4):  # as chosen for the batch (up to 8 here), one, four partitions
        got = attn.paged_decode_attention(
            q, kv, meta.block_tables, meta.seq_lens, dim**-0.5, parts=parts
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (24, 0.0), (0, 2.0), (7, 3.0)])
def test_decode_attention_with_window_and_softcap(window, softcap):
    """Sliding-window layers read only each request's last ``window`` positions (contexts
    shorter and longer than the window, across partitions); soft-capped scores match the
    torch reference."""
    torch.manual_seed(window + int(softcap))
    lens = [1, 6, 33, 70]
    kv = torch.randn(2, 64, 8, 2, 32)
    meta = decode_meta(lens, 8, 64, seed=5, extra_columns=2)
    q = torch.randn(len(lens), 4, 32) * 3  # large scores: the cap bends them
    expected = _decode_attention(q, kv, meta, 0.3, window=window, softcap=softcap)
    for parts in (1, 4):
        got = attn.paged_decode_attention(
            q,
            kv,
            meta.block_tables,
            meta.seq_lens,
            0.3,
            parts=parts,
            window=window,
            softcap=softcap,
        )
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_decode_attention_stores_the_new_tokens_first():
    """With key/value/slots, each request's new key and value land in its slot and are part
    of its context, as if written before the call."""
    torch.manual_seed(7)
    lens = [1, 17, 40]
    kv = torch.randn(2, 32, 8, 2, 32)
    meta = decode_meta(lens, 8, 32, seed=3)
    slots = last_token_slots(meta)
    qkv = torch.randn(3, 4 + 2 + 2, 32)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    expected_cache = kv.clone()
    flat = expected_cache.view(2, -1, 2, 32)
    flat[0, slots], flat[1, slots] = k, v
    expected = _decode_attention(q, expected_cache, meta, 0.3)
    for parts in (1, 2, 8):  # the new token is in the last partition that has any
        cache = kv.clone()
        got = attn.paged_decode_attention(
            q, cache, meta.block_tables, meta.seq_lens, 0.3, k, v, slots, parts=parts
        )
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_partitions_for_batch_shapes():
    cpu = torch.device("cpu")  # the interpreter counts an H200's 132 multiprocessors
    assert attn.partitions_for(64, 8, cpu) == 1  # 512 programs already
    assert attn.partitions_for(4, 8, cpu) == 4  # 32 -> 128 programs >= 132 / 2
    assert attn.partitions_for(1, 8, cpu) == attn.MAX_PARTS


def test_decode_attention_ignores_unread_slots():
    """Slots past a request's length (and the padding columns' blocks) may hold anything,
    NaN included, without reaching the output."""
    torch.manual_seed(1)
    kv = torch.randn(2, 16, 4, 2, 32)
    meta = decode_meta([6, 9], 4, 16, seed=2)
    clean = attn.paged_decode_attention(
        torch.randn(2, 4, 32), kv, meta.block_tables, meta.seq_lens, 0.2
    )
    q = torch.randn(2, 4, 32)
    ref = attn.paged_decode_attention(q, kv, meta.block_tables, meta.seq_lens, 0.2)
    poisoned = kv.clone()
    for i, n in enumerate([6, 9]):
        last = meta.block_tables[i, (n - 1) // 4]
        poisoned[:, last, n % 4 or 4 :] = float("nan")
    poisoned[:, 0] = float("nan")  # the padding columns point at block 0
    got = attn.paged_decode_attention(q, poisoned, meta.block_tables, meta.seq_lens, 0.2)
    assert clean.isfinite().all()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


def test_backend_writes_kv_and_mixes_prefills():
    """The registered backend stores every new token's KV, runs Triton decodes and torch
    prefills, and equals the torch backend on the same step."""
    attn.register()
    from common.torch.attention import get_attention_backend

    torch.manual_seed(3)
    heads, kv_heads, dim, bs, num_blocks = 4, 2, 16, 4, 32
    meta = mixed_meta(bs, num_blocks, seed=1)
    q, k, v = (torch.randn(5, h, dim) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim)
    ref_cache = cache.clone()
    got = get_attention_backend(attn.BACKEND_NAME)(q, k, v, cache, meta, 0.25)
    expected = torch_paged_attention(q, k, v, ref_cache, meta, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_reference(dtype):
    torch.manual_seed(4)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    for hidden in (64, 96):
        x = (torch.randn(5, hidden) * 3).to(dtype)
        w = torch.randn(hidden).to(dtype)
        torch.testing.assert_close(
            ops.rms_norm(x, w, 1e-5), TORCH_LAYER_OPS.rms_norm(x, w, 1e-5), **tol
        )
        res = torch.randn(5, hidden).to(dtype)
        res_ref = res.clone()
        got = ops.add_rms_norm(x, res, w, 1e-6)
        expected = TORCH_LAYER_OPS.add_rms_norm(x, res_ref, w, 1e-6)
        # The same rounded sum (the interpreter rounds float32 -> bfloat16 toward zero, the GPU
        # to nearest: one bfloat16 ulp apart there).
        exact = {"rtol": 0, "atol": 0} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 0}
        torch.testing.assert_close(res, res_ref, **exact)
        torch.testing.assert_close(got, expected, **tol)
    assert ops.rms_norm(torch.zeros(0, 64), torch.ones(64), 1e-6).shape == (0, 64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_matches_reference(dtype):
    torch.manual_seed(5)
    from common.torch.models.llama import RotaryEmbedding

    rope = RotaryEmbedding(32, 128, 10000.0, None)
    positions = torch.tensor([0, 5, 127, 64, 3])
    qkv = torch.randn(5, 6 + 2 * 2, 32).to(dtype)  # 6 query, 2 key, 2 value heads
    expected = TORCH_LAYER_OPS.rotary(
        qkv, 8, TORCH_LAYER_OPS.rope_for_step(rope.cos_sin, positions, dtype)
    )
    untouched = qkv[:, 8:].clone()
    got = ops.rotary(qkv, 8, ops.rope_for_step(rope.cos_sin, positions, dtype))
    assert got.data_ptr() == qkv.data_ptr()  # in place, a view of the first 8 heads
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(got, expected, **tol)
    torch.testing.assert_close(qkv[:, 8:], untouched, rtol=0, atol=0)  # values left alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul_matches_reference(dtype):
    torch.manual_seed(6)
    tol = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    for inter in (48, 1500):  # one partial block; several blocks per row
        x = (torch.randn(3, 2 * inter) * 4).to(dtype)
        torch.testing.assert_close(ops.silu_and_mul(x), TORCH_LAYER_OPS.silu_and_mul(x), **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_match_reference(dtype):
    """The CUDA set's logits (rows-in-order product, then float32) against the torch set's:
    float32 [rows, vocab], contiguous, the same values (bf16: rounded to bf16 by both)."""
    torch.manual_seed(7)
    hidden = torch.randn(5, 64).to(dtype)
    weight = (torch.randn(1000, 64) * 0.1).to(dtype)
    got = ops.CUDA_LAYER_OPS.logits(hidden, ops.CUDA_LAYER_OPS.prepare_logits(weight))
    want = TORCH_LAYER_OPS.logits(hidden, TORCH_LAYER_OPS.prepare_logits(weight))
    assert got.dtype == torch.float32 and got.shape == (5, 1000) and got.is_contiguous()
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.testing.assert_close(got, want, **tol)


def test_kernels_compile_for_sm90():
    """The compiler's own checks (types of loop-carried values, layouts), which the interpreter
    skips: every kernel is compiled to a Hopper cubin in a separate process."""
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    run = subprocess.run(
        [sys.executable, script], env=env, capture_output=True, text=True, timeout=600
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "all kernels compiled" in run.stdout
