"""The CPU paged attention kernel against the torch reference (gathered copy + SDPA)."""

from __future__ import annotations

import pytest
import torch

from common.torch.attention import get_attention_backend, torch_paged_attention
from executor_gpu.cpu import attention as cpu_attention
from executor_gpu.cpu.kernels import load_kernels
from tests.executor_gpu.paged_cases import step_meta

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernel")


def run_both(
    meta, heads: int, kv_heads: int, dim: int, block_size: int, num_blocks: int, scale: float
):
    """The registered backend and the reference on the same step over copies of one random
    cache: (outputs, caches) of each."""
    assert cpu_attention.register()
    tokens = meta.query_start_loc_host[-1]
    qkv = torch.randn(tokens, heads + 2 * kv_heads, dim)  # q, k, v are views of one tensor
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    expected_cache, got_cache = cache.clone(), cache.clone()
    expected = torch_paged_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), expected_cache, meta, scale
    )
    meta.derived.clear()
    got = get_attention_backend(cpu_attention.BACKEND_NAME)(q, k, v, got_cache, meta, scale)
    return (got, expected), (got_cache, expected_cache)


# Head sizes of whole 16-float vectors up to 128 are the kernel's (64, 32, 128, 80, 16); others
# (24, 144) fall back to the torch implementation.
@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [
        (9, 3, 64, 16),
        (8, 8, 32, 4),
        (4, 1, 128, 16),
        (6, 2, 80, 8),
        (10, 2, 16, 4),
        (6, 2, 24, 8),
        (2, 1, 144, 16),
    ],
)
# Up to a few decodes per thread, tasks split them by KV head; with more (the 20), each decode is
# one task over all its KV heads.
@pytest.mark.parametrize(
    "lens", [[1], [5, 17, 16, 33], [200] * 3 + [1, 64], [3 + 3 * i for i in range(20)]]
)
def test_decodes_match_the_reference(heads, kv_heads, dim, block_size, lens):
    """A decode step: each request's new key and value stored, then attended with the rest."""
    torch.manual_seed(len(lens) * heads)
    num_blocks = 256
    meta = step_meta(lens, [1] * len(lens), block_size, num_blocks, seed=heads)
    (got, expected), (got_cache, expected_cache) = run_both(
        meta, heads, kv_heads, dim, block_size, num_blocks, dim**-0.5
    )
    assert torch.equal(got_cache, expected_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize(
    "dtype,bf16_dot",
    [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)],
    ids=["float32", "bf16-widened", "bf16-dot"],
)
@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 48), (8, 2, 16)]
)
def test_decodes_taken_whole_match_one_at_a_time(
    threads, num_threads, dtype, bf16_dot, heads, kv_heads, dim
):
    """With enough decodes each is one task that reads its tokens' whole cache rows (every KV
    head at once); alone, a decode is split by KV head (every shape here has 2+ KV heads: with
    one, a decode alone is whole rows too). Both do the same arithmetic per head:
    bf16 outputs are identical, float32 ones differ at most in which product of a dot product
    the compiler fuses into a multiply-add."""
    threads(num_threads)
    torch.manual_seed(heads * dim)
    lens = [3 + 7 * i for i in range(20)]  # 20 decodes: taken whole up to 5 threads
    meta = step_meta(lens, [1] * len(lens), 16, 128, seed=heads)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    cache = torch.randn(2, 128, 16, kv_heads, dim).to(dtype)
    module = load_kernels()
    whole = module.paged_attention(
        q,
        None,
        None,
        None,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        0.3,
        bf16_dot,
    )
    one = torch.tensor([0, 1], dtype=torch.int32)
    alone = torch.cat(
        [
            module.paged_attention(
                q[i : i + 1],
                None,
                None,
                None,
                cache,
                meta.block_tables[i : i + 1],
                meta.seq_lens[i : i + 1],
                one,
                0.3,
                bf16_dot,
            )
            for i in range(len(lens))
        ]
    )
    if dtype == torch.bfloat16:
        assert torch.equal(whole, alone)
    else:
        torch.testing.assert_close(whole, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (6, 2, 16, 4)]
)
@pytest.mark.parametrize(
    "lens,new",
    [
        ([7], [7]),  # one prefill from scratch
        ([40, 9, 14], [40, 1, 1]),  # a prefill of several query runs, then decodes
        ([9, 14, 7, 50], [1, 1, 3, 21]),  # decodes, then chunks after cached tokens
        ([100, 33, 1], [17, 33, 1]),  # a chunk, a whole prompt, a one-token prompt
        ([9 + i for i in range(12)] + [50], [1] * 12 + [21]),  # decodes taken whole, a chunk
    ],
)
def test_prefill_chunks_match_the_reference(heads, kv_heads, dim, block_size, lens, new):
    """Mixed steps: every query token attends causally to its request's cached and new
    tokens, all of whose keys and values the kernel stores first."""
    torch.manual_seed(sum(lens))
    num_blocks = 128
    meta = step_meta(lens, new, block_size, num_blocks, seed=dim)
    (got, expected), (got_cache, expected_cache) = run_both(
        meta, heads, kv_heads, dim, block_size, num_blocks, 0.3
    )
    assert torch.equal(got_cache, expected_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_profiling_steps_without_a_cache_use_the_reference():
    """Before the cache exists (memory profiling) the backend attends the new tokens alone."""
    meta = step_meta([5, 3], [5, 3], 4, 16, seed=0)
    q, k, v = torch.randn(8, 4, 32), torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    expected = torch_paged_attention(q, k, v, None, meta, 0.2)
    got = cpu_attention.paged_attention_of(load_kernels())(q, k, v, None, meta, 0.2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_rejects_inconsistent_steps():
    """Query tokens past a request's length, or a start list that does not span the query
    tokens, are errors, not reads out of bounds."""
    kernel = load_kernels().paged_attention
    cache = torch.zeros(2, 8, 4, 1, 16)
    q = torch.randn(3, 1, 16)
    tables = torch.tensor([[1, 2]])
    with pytest.raises(RuntimeError, match="fit its length"):
        kernel(q, None, None, None, cache, tables, torch.tensor([2]), torch.tensor([0, 3]), 1.0)
    with pytest.raises(RuntimeError, match="span"):
        kernel(q, None, None, None, cache, tables, torch.tensor([5]), torch.tensor([0, 2]), 1.0)
    with pytest.raises(RuntimeError, match="block table"):
        kernel(q, None, None, None, cache, tables, torch.tensor([9]), torch.tensor([0, 3]), 1.0)
