"""The batched paged prefill kernel (executor_gpu/cuda/triton_prefill.py) under Triton's
interpreter, against a float32 torch reference written out here: causal over the cached prefix
plus the chunk, GQA, shuffled non-contiguous blocks, chunks that start mid-block, several
requests of different lengths in one launch, sliding windows and soft-capping.

tests/conftest.py sets ``TRITON_INTERPRET=1`` before triton is imported.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.torch.attention import get_attention_backend, torch_paged_attention, visible_keys

triton = pytest.importorskip("triton")

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it before triton loads
    pytest.skip(
        "TRITON_INTERPRET=1 was not set before triton was imported", allow_module_level=True
    )

from executor_gpu.cuda import triton_attention  # noqa: E402
from executor_gpu.cuda import triton_prefill as pf  # noqa: E402
from tests.executor_gpu.paged_cases import step_meta  # noqa: E402

# (context lengths, new tokens): two decodes, a prefill from scratch, a chunk starting mid-block
# after 3 cached tokens, and a 6-token chunk after a 61-token cached prefix (a prefix-cache hit).
LENS, NEW = [9, 14, 40, 23, 67], [1, 1, 40, 20, 6]


def reference(q, cache, meta, scale, window=0, softcap=0.0, first=None):
    """Each prefilling request's queries against its context gathered position by position
    through its block table, in float32: [T, heads, d] (decode rows left zero)."""
    _, _, bs, kv_heads, dim = cache.shape
    flat = cache.float().view(2, -1, kv_heads, dim)
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float32)
    qsl = meta.query_start_loc_host
    first = meta.num_decodes if first is None else first
    for r in range(first, meta.num_requests):
        n, seq_len = qsl[r + 1] - qsl[r], meta.seq_lens_host[r]
        pos = torch.arange(seq_len)
        slots = meta.block_tables[r, pos // bs] * bs + pos % bs
        keys = flat[0, slots].repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, d]
        values = flat[1, slots].repeat_interleave(group, dim=1).transpose(0, 1)
        qr = q[qsl[r] : qsl[r + 1]].float().transpose(0, 1)  # [H, n, d]
        scores = qr @ keys.transpose(1, 2) * scale
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
        seen = visible_keys(pos[None, :], torch.arange(seq_len - n, seq_len)[:, None], window)
        scores = scores.masked_fill(~seen, float("-inf"))
        out[qsl[r] : qsl[r + 1]] = (scores.softmax(-1) @ values).transpose(0, 1)
    return out


def run_kernel(q, cache, meta, scale, **kw):
    out = torch.zeros_like(q)
    longest = max(b - a for a, b in zip(meta.query_start_loc_host, meta.query_start_loc_host[1:]))
    return pf.paged_prefill_attention(
        q,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        meta.num_decodes,
        meta.num_requests - meta.num_decodes,
        longest,
        out,
        **kw,
    )


@pytest.mark.parametrize(
    "heads,kv_heads,dim,block_size",
    [
        (8, 2, 64, 16),  # GQA group of 4
        (6, 2, 80, 16),  # group of 3, a head size that is not a power of two (padded)
        (4, 4, 32, 8),  # no grouping; blocks smaller than the key tile
        (4, 1, 16, 48),  # blocks larger than the tile, not a power of two
    ],
)
def test_prefill_matches_reference(heads, kv_heads, dim, block_size):
    torch.manual_seed(heads + dim)
    num_blocks = 48
    cache = torch.randn(2, num_blocks, block_size, kv_heads, dim)
    meta = step_meta(LENS, NEW, block_size, num_blocks, seed=heads)
    # Queries as a strided view of a fused q|k|v tensor, as the model passes them.
    q = torch.randn(sum(NEW), heads + 2 * kv_heads, dim)[:, :heads]
    expected = reference(q, cache, meta, dim**-0.5)
    got = run_kernel(q, cache, meta, dim**-0.5)
    torch.testing.assert_close(got[2:], expected[2:], rtol=1e-5, atol=1e-5)
    assert (got[:2] == 0).all()  # the decodes' rows are not the kernel's


@pytest.mark.parametrize("block_m,block_n", [(32, 16), (16, 32)])
def test_prefill_tiles_other_than_the_default(block_m, block_n):
    """Query tiles longer than a chunk, key tiles spanning blocks: the same result."""
    torch.manual_seed(block_m)
    cache = torch.randn(2, 48, 8, 2, 32)
    meta = step_meta(LENS, NEW, 8, 48, seed=9)
    q = torch.randn(sum(NEW), 4, 32)
    got = run_kernel(q, cache, meta, 0.2, block_m=block_m, block_n=block_n)
    torch.testing.assert_close(got[2:], reference(q, cache, meta, 0.2)[2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(5, 0.0), (24, 0.0), (0, 2.0), (7, 3.0)])
def test_prefill_with_window_and_softcap(window, softcap):
    """Sliding windows shorter than a chunk and longer than some contexts (rows whose window
    starts past the first key tile); soft-capped scores."""
    torch.manual_seed(window)
    cache = torch.randn(2, 48, 8, 2, 32)
    meta = step_meta(LENS, NEW, 8, 48, seed=4)
    q = torch.randn(sum(NEW), 4, 32) * 3  # large scores: the cap bends them
    expected = reference(q, cache, meta, 0.3, window, softcap)
    got = run_kernel(q, cache, meta, 0.3, window=window, softcap=softcap)
    torch.testing.assert_close(got[2:], expected[2:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_prefill_in_16_bit_against_float32(dtype):
    torch.manual_seed(2)
    cache = torch.randn(2, 48, 16, 2, 64)
    meta = step_meta(LENS, NEW, 16, 48, seed=6)
    q = torch.randn(sum(NEW), 8, 64)
    expected = reference(q.to(dtype), cache.to(dtype), meta, 0.125)
    got = run_kernel(q.to(dtype), cache.to(dtype), meta, 0.125)
    assert got.dtype == dtype
    torch.testing.assert_close(got[2:].float(), expected[2:], rtol=2e-2, atol=2e-2)


def test_prefill_ignores_unread_slots():
    """Slots past a request's length, other requests' blocks and the padding columns' block 0
    may hold NaN without reaching the output."""
    torch.manual_seed(3)
    cache = torch.randn(2, 48, 8, 2, 32)
    meta = step_meta(LENS, NEW, 8, 48, seed=2)
    q = torch.randn(sum(NEW), 4, 32)
    clean = run_kernel(q, cache, meta, 0.2)
    poisoned = cache.clone()
    poisoned[:, 0] = float("nan")
    for r, n in enumerate(LENS):
        last = meta.block_tables[r, (n - 1) // 8]
        poisoned[:, last, n % 8 or 8 :] = float("nan")
    got = run_kernel(q, poisoned, meta, 0.2)
    assert got[2:].isfinite().all()
    torch.testing.assert_close(got, clean, rtol=0, atol=0)


def test_prefill_without_a_cache_reads_the_step_keys():
    """kv_cache=None (the profiling pass): every request from position 0, keys and values read
    from the packed step tensors, all requests in the launch."""
    torch.manual_seed(8)
    lens = [5, 1, 30, 17]
    meta = step_meta(lens, lens, 8, 32, seed=1)
    qkv = torch.randn(sum(lens), 4 + 2 + 2, 32)
    q, k, v = qkv[:, :4], qkv[:, 4:6], qkv[:, 6:]
    expected = torch_paged_attention(q, k, v, None, meta, 0.3)
    out = torch.zeros_like(q)
    pf.paged_prefill_attention(
        q, None, meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.3, 0, 4, 30, out, k, v
    )
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [0, 6])
def test_backend_runs_a_mixed_step_in_two_launches(window, monkeypatch):
    """The registered "triton_paged" backend on a step of decodes and prefill chunks: one
    decode launch and one prefill launch, the cache written as by the torch backend, the same
    output."""
    triton_attention.register()
    launches = []
    decode_kernel, prefill_kernel = triton_attention._paged_decode_kernel, pf._paged_prefill_kernel
    for module, name, kernel in (
        (triton_attention, "_paged_decode_kernel", decode_kernel),
        (pf, "_paged_prefill_kernel", prefill_kernel),
    ):
        monkeypatch.setattr(module, name, _Counting(kernel, name, launches))
    torch.manual_seed(5)
    heads, kv_heads, dim, bs = 4, 2, 16, 8
    meta = step_meta(LENS, NEW, bs, 48, seed=7)
    q, k, v = (torch.randn(sum(NEW), h, dim) for h in (heads, kv_heads, kv_heads))
    cache = torch.randn(2, 48, bs, kv_heads, dim)
    ref_cache = cache.clone()
    got = get_attention_backend(triton_attention.BACKEND_NAME)(
        q, k, v, cache, meta, 0.25, window=window
    )
    expected = torch_paged_attention(q, k, v, ref_cache, meta, 0.25, window=window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache, ref_cache, rtol=0, atol=0)
    assert launches == ["_paged_decode_kernel", "_paged_prefill_kernel"]


class _Counting:
    """A jitted kernel whose launches are recorded by name."""

    def __init__(self, kernel, name: str, launches: list[str]):
        self.kernel, self.name, self.launches = kernel, name, launches

    def __getitem__(self, grid):
        self.launches.append(self.name)
        return self.kernel[grid]


@pytest.mark.parametrize(
    "lens,new,softcap,kernels",
    [
        # A fresh prompt alone beside decodes: torch's fused attention, no prefill kernel.
        ([9, 14, 40], [1, 1, 40], 0.0, ["_paged_decode_kernel"]),
        # The same with soft-capping, which torch's fused attention lacks: the kernel.
        ([9, 14, 40], [1, 1, 40], 5.0, ["_paged_decode_kernel", "_paged_prefill_kernel"]),
        # A lone chunk after a cached prefix, and two fresh prompts: the kernel.
        ([9, 67], [1, 6], 0.0, ["_paged_decode_kernel", "_paged_prefill_kernel"]),
        ([30, 40], [30, 40], 0.0, ["_paged_prefill_kernel"]),
    ],
)
def test_backend_leaves_a_lone_fresh_prompt_to_torch(lens, new, softcap, kernels, monkeypatch):
    """Which launches a step makes: a step whose only chunk is a whole fresh prompt goes to
    torch's fused attention; every other one to the prefill kernel; the output is the torch
    backend's either way."""
    triton_attention.register()
    launches: list[str] = []
    for module, name in ((triton_attention, "_paged_decode_kernel"), (pf, "_paged_prefill_kernel")):
        monkeypatch.setattr(module, name, _Counting(getattr(module, name), name, launches))
    torch.manual_seed(8)
    meta = step_meta(lens, new, 8, 48, seed=3)
    q, k, v = (torch.randn(sum(new), h, 16) for h in (4, 2, 2))
    cache = torch.randn(2, 48, 8, 2, 16)
    ref_cache = cache.clone()
    got = get_attention_backend(triton_attention.BACKEND_NAME)(
        q, k, v, cache, meta, 0.25, softcap=softcap
    )
    expected = torch_paged_attention(q, k, v, ref_cache, meta, 0.25, softcap=softcap)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert launches == kernels


def test_a_setting_past_the_shared_memory_falls_back_to_the_next(monkeypatch):
    """A launch setting the compiler rejects for lack of shared memory (OutOfResources, raised
    before anything runs) is passed over for the next one, which is then remembered."""
    from triton.runtime.errors import OutOfResources

    tried = []
    kernel = pf._paged_prefill_kernel

    class TooBigFirst:
        def __getitem__(self, grid):
            def launch(*args, **kw):
                tried.append((kw["BLOCK_M"], kw["BLOCK_N"], kw["num_stages"]))
                if kw["BLOCK_N"] == 128:
                    raise OutOfResources(229376, 166912, "shared memory")
                return kernel[grid](*args, **kw)

            return launch

    monkeypatch.setattr(pf, "_paged_prefill_kernel", TooBigFirst())
    monkeypatch.setattr(pf, "_FITTED", {})
    monkeypatch.setattr(pf, "launch_settings", lambda *a: ((64, 128, 4, 3), (32, 16, 4, 2)))
    torch.manual_seed(9)
    meta = step_meta([9, 40], [1, 40], 8, 16, seed=1)
    q = torch.randn(41, 4, 16)
    cache = torch.randn(2, 16, 8, 2, 16)
    got = run_kernel(q, cache, meta, 0.25)
    torch.testing.assert_close(got[1:], reference(q, cache, meta, 0.25)[1:], rtol=1e-5, atol=1e-5)
    assert tried == [(64, 128, 3), (32, 16, 2)]
    assert list(pf._FITTED.values()) == [(32, 16, 4, 2)]
