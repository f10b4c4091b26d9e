"""The CPU decode attention kernel against the torch reference (gathered copy + SDPA)."""

from __future__ import annotations

import pytest
import torch

from common.attention import _decode_attention, torch_paged_attention
from executor_gpu import cpu_attention
from executor_gpu.cpu_kernels import load_kernels
from tests.paged_cases import decode_meta, last_token_slots, mixed_meta

pytestmark = pytest.mark.skipif(load_kernels() is None,
                                reason="no C++ toolchain for the kernel")


# Head sizes of whole 16-float vectors take the vectorized path (64, 32, 128, 80); others (24,
# 144) the scalar one.
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (8, 8, 32, 4),
                                                           (4, 1, 128, 16), (6, 2, 80, 8),
                                                           (6, 2, 24, 8), (2, 1, 144, 16)])
@pytest.mark.parametrize("lens", [[1], [5, 17, 16, 33], [200] * 3 + [1, 64]])
def test_kernel_matches_reference(heads, kv_heads, dim, block_size, lens):
    torch.manual_seed(len(lens) * heads)
    num_blocks = 256
    kv = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    meta = decode_meta(lens, block_size, num_blocks, seed=heads)
    q = torch.randn(len(lens), heads, dim)
    expected = _decode_attention(q, kv, meta, dim ** -0.5)
    decode = cpu_attention.decode_attention_of(load_kernels())
    got = decode(q, kv, meta, dim ** -0.5)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_backend_mixes_kernel_decodes_and_torch_prefills():
    """Decodes first, then a 3-token chunk: the registered backend equals the reference."""
    assert cpu_attention.register()
    from common.attention import get_attention_backend

    torch.manual_seed(0)
    heads, kv_heads, dim, bs, num_blocks = 6, 2, 16, 4, 32
    meta = mixed_meta(bs, num_blocks, seed=1)
    q, k, v = (torch.randn(5, h, dim) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim)
    expected = torch_paged_attention(q, k, v, cache.clone(), meta, 0.25)
    meta.derived.clear()
    got = get_attention_backend(cpu_attention.BACKEND_NAME)(q, k, v, cache.clone(), meta, 0.25)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_kernel_stores_the_decodes_keys_and_values():
    """With new keys/values given, the kernel writes their slots, then attends: the same cache
    and output as a separate write followed by attention."""
    from common.attention import write_kv

    torch.manual_seed(3)
    heads, kv_heads, dim, bs, num_blocks = 9, 3, 64, 16, 32
    lens = [5, 16, 17, 40]
    meta = decode_meta(lens, bs, num_blocks, seed=2)
    meta.slot_mapping = last_token_slots(meta)
    qkv = torch.randn(len(lens), heads + 2 * kv_heads, dim)  # q, k, v are views of one tensor
    q, k, v = qkv[:, :heads], qkv[:, heads:heads + kv_heads], qkv[:, heads + kv_heads:]
    cache = torch.randn(2, num_blocks, bs, kv_heads, dim)
    expected_cache = cache.clone()
    write_kv(expected_cache, k, v, meta.slot_mapping)
    expected = _decode_attention(q.contiguous(), expected_cache, meta, 0.125)
    decode = cpu_attention.decode_attention_of(load_kernels())
    got = decode(q, cache, meta, 0.125, key=k, value=v)
    assert torch.equal(cache, expected_cache)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
