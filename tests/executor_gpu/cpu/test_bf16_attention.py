"""The CPU attention kernel over a bf16 cache in both its forms: the scores from AVX-512 bf16
dot products (where the CPU has them) and from keys widened to float32, against float32
attention over the same bf16 inputs, for every head size class the kernel takes."""

from __future__ import annotations

import pytest
import torch

from common.torch.attention import torch_paged_attention
from executor_gpu.cpu import attention as cpu_attention
from executor_gpu.cpu.kernels import load_kernels
from tests.executor_gpu.paged_cases import step_meta

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")

BF16 = torch.bfloat16
DOT = load_kernels() is not None and load_kernels().bf16_dot_supported()
FORMS = [
    pytest.param(True, id="dot", marks=pytest.mark.skipif(not DOT, reason="no AVX-512 bf16")),
    pytest.param(False, id="widened"),
]
# (heads, kv_heads, head size): grouped queries of 3 (SmolLM2) and 4, one head per KV head; head
# sizes of an even number of 16-value vectors (the 32-value bf16 loops) and an odd one (48).
SHAPES = [(9, 3, 64), (8, 2, 128), (4, 4, 32), (6, 2, 48)]


def attend(lens, new, shape, bf16_dot, seed=0):
    """(kernel output, float32 reference) for one step over a random bf16 cache."""
    heads, kv_heads, dim = shape
    torch.manual_seed(seed)
    meta = step_meta(lens, new, 16, 48, seed=seed)
    tokens = meta.query_start_loc_host[-1]
    q = (torch.randn(tokens, heads, dim)).to(BF16)
    kv = (torch.randn(tokens, 2, kv_heads, dim)).to(BF16)
    cache = torch.randn(2, 48, 16, kv_heads, dim).to(BF16)
    ref_cache = cache.float()
    scale = dim**-0.5
    expected = torch_paged_attention(
        q.float(), kv[:, 0].float(), kv[:, 1].float(), ref_cache, meta, scale
    )
    got = load_kernels().paged_attention(
        q,
        kv[:, 0],
        kv[:, 1],
        meta.slot_mapping,
        cache,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale,
        bf16_dot,
    )
    return got, expected


@pytest.mark.parametrize("bf16_dot", FORMS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize(
    "lens,new",
    [
        ([40, 1, 17, 100], [1, 1, 1, 1]),
        ([1 + 2 * i for i in range(20)], [1] * 20),
        ([70, 33, 5], [1, 20, 5]),
    ],
    ids=["decodes", "decodes_whole", "mixed"],
)
def test_bf16_attention_forms(lens, new, shape, bf16_dot):
    """Both forms are float32 attention over the bf16 values (products exact, sums in float32),
    rounded to bf16 once: within a bf16 unit of the float32 reference."""
    got, expected = attend(lens, new, shape, bf16_dot)
    assert got.dtype == BF16
    torch.testing.assert_close(got, expected.to(BF16), rtol=2**-7, atol=2e-3)


@pytest.mark.skipif(not DOT, reason="no AVX-512 bf16")
def test_forms_agree():
    """The two forms differ only in how a score's float32 sum is grouped."""
    lens, new = [150, 64, 9], [1, 1, 9]
    dot, _ = attend(lens, new, (9, 3, 64), True, seed=5)
    widened, _ = attend(lens, new, (9, 3, 64), False, seed=5)
    torch.testing.assert_close(dot, widened, rtol=2**-7, atol=1e-3)


def test_float32_ignores_the_flag():
    """A float32 cache attends the same with or without bf16_dot."""
    module = load_kernels()
    meta = step_meta([33, 1], [1, 1], 16, 8, seed=2)
    q = torch.randn(2, 4, 64)
    cache = torch.randn(2, 8, 16, 2, 64)
    args = (meta.block_tables, meta.seq_lens, meta.query_start_loc, 0.125)
    plain = module.paged_attention(q, None, None, None, cache, *args)
    flagged = module.paged_attention(q, None, None, None, cache, *args, True)
    assert torch.equal(plain, flagged)


def test_the_backend_follows_the_environment(monkeypatch):
    """TANDEM_CPU_BF16_DOT=0 keeps the widened form in the attention backend too."""
    seen = []

    class Spy:
        paged_attention_supports = staticmethod(lambda d: True)

        @staticmethod
        def bf16_dot_supported():
            return True

        @staticmethod
        def paged_attention(*args):
            seen.append(args[-1])

    meta = step_meta([5], [1], 16, 4, seed=1)
    x = torch.zeros(1, 1, 64)
    for env, dot in (("1", True), ("0", False)):
        monkeypatch.setenv("TANDEM_CPU_BF16_DOT", env)
        cpu_attention.paged_attention_of(Spy)(x, x, x, torch.zeros(2, 4, 16, 1, 64), meta, 0.1)
        assert seen[-1] is dot
