"""The CPU kernels in bfloat16 (bf16 storage, float32 arithmetic, rounded where the reference
rounds) against the torch reference computed in bf16, and against float32 arithmetic over the
same bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from common.torch.attention import get_attention_backend, torch_paged_attention
from common.torch.models.layer_ops import TORCH_LAYER_OPS as REF
from common.torch.models.llama import RotaryEmbedding
from executor_gpu.cpu import attention as cpu_attention
from executor_gpu.cpu.kernels import load_kernels
from executor_gpu.cpu.layer_ops import layer_ops
from tests.executor_gpu.paged_cases import step_meta

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")

BF16 = torch.bfloat16
# Two bf16 units in the last place, relative: an intermediate value that the reference rounds to
# bf16 (then multiplies, then rounds again) may land on the other side of a bf16 midpoint when
# its float32 value is summed in another order.
ULP = {"rtol": 2**-6, "atol": 1e-6}


DOT = load_kernels() is not None and load_kernels().bf16_dot_supported()
# The linear layers' two bf16 forms: AVX-512 bf16 dot products over pair-interleaved panels
# (where the CPU has them), and the float32-FMA fallback over plain bf16 panels.
FORMS = [
    pytest.param(True, id="dot", marks=pytest.mark.skipif(not DOT, reason="no AVX-512 bf16")),
    pytest.param(False, id="fma"),
]


@pytest.fixture(scope="module", params=FORMS)
def fused(request):
    return layer_ops(bf16_dot=request.param)


def randn(*shape, scale=1.0):
    return (torch.randn(*shape) * scale).to(BF16)


@pytest.mark.parametrize("rows", [1, 7, 700])
def test_rms_norm_and_residual_add(fused, rows):
    torch.manual_seed(rows)
    x, res, w = randn(rows, 576, scale=3), randn(rows, 576), randn(576)
    got = fused.rms_norm(x, w, 1e-5)
    assert got.dtype == BF16
    torch.testing.assert_close(got, REF.rms_norm(x, w, 1e-5), **ULP)
    r_ref, r_got = res.clone(), res.clone()
    expected = REF.add_rms_norm(x, r_ref, w, 1e-5)
    got = fused.add_rms_norm(x, r_got, w, 1e-5)
    assert torch.equal(r_got, r_ref)  # the bf16 residual sum is rounded as torch rounds it
    torch.testing.assert_close(got, expected, **ULP)


@pytest.mark.parametrize("rows", [1, 6, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear(fused, rows, bias):
    """bf16 panels, float32 sums, one rounding per output: float32 arithmetic on the bf16
    values, rounded once."""
    torch.manual_seed(rows)
    w, x = randn(96, 192, scale=0.1), randn(rows, 96)
    b = randn(192) if bias else None
    packed = fused.prepare_linear(w)
    assert packed.dtype == BF16 and packed.dim() > 2
    exact = x.float() @ w.float() + (b.float() if bias else 0)
    got = fused.linear(x, packed, b)
    assert got.dtype == BF16
    torch.testing.assert_close(got, exact.to(BF16), rtol=2**-7, atol=1e-6)


@pytest.mark.skipif(not DOT, reason="no AVX-512 bf16")
@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_packed_forms_agree(rows):
    """The dot-product form against the fallback on the same inputs: both are float32 sums of
    exact bf16 products rounded once, so they differ only by summation order (a rounding that
    lands on the other side of a bf16 midpoint: one bf16 unit, rarely)."""
    torch.manual_seed(rows)
    module = load_kernels()
    w, x, b = randn(576, 192, scale=0.05), randn(rows, 576), randn(192)
    pairs = module.pack_linear_weight(w, True)
    assert pairs.shape == (3, 288, 64, 2)
    assert torch.equal(pairs[1, 5, 7], torch.stack([w[10, 71], w[11, 71]]))
    got = module.packed_linear(x, pairs, b)
    fallback = module.packed_linear(x, module.pack_linear_weight(w), b)
    torch.testing.assert_close(got, fallback, rtol=2**-7, atol=1e-6)
    assert (got != fallback).float().mean() < 0.01


def test_pairs_need_bf16_of_even_depth():
    module = load_kernels()
    with pytest.raises(RuntimeError, match="pairs take a bfloat16"):
        module.pack_linear_weight(torch.randn(64, 64), True)
    with pytest.raises(RuntimeError, match="pairs take a bfloat16"):
        module.pack_linear_weight(randn(63, 64), True)


def test_the_dot_form_is_chosen_by_cpu_and_environment(monkeypatch):
    """TANDEM_CPU_BF16_DOT=0 forces the fallback; otherwise the CPU's flags decide."""
    module = load_kernels()
    w = randn(64, 128)
    assert layer_ops().prepare_linear(w).dim() == (4 if DOT else 3)
    assert layer_ops().prepare_linear(w.float()).dim() == 3  # float32: never pairs
    monkeypatch.setenv("TANDEM_CPU_BF16_DOT", "0")
    assert layer_ops().prepare_linear(w).dim() == 3
    assert module.bf16_dot_supported() == DOT


def test_logits_are_float32(fused):
    emb = randn(256, 64)
    hidden = randn(3, 64)
    prepared = fused.prepare_logits(emb)
    got = fused.logits(hidden, prepared)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, (hidden.float() @ emb.float().t()), rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 64])
def test_silu_and_mul(fused, rows):
    torch.manual_seed(rows)
    gate_up = randn(rows, 2 * 1536, scale=4)
    torch.testing.assert_close(fused.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), **ULP)


def test_rotary_rounds_as_the_reference(fused):
    """transformers' bf16 rotation: cos and sin rounded to bf16, ``q * cos + rotate_half(q) *
    sin`` with each product and the sum rounded: the kernel rounds at the same points."""
    torch.manual_seed(0)
    rope = RotaryEmbedding(64, 512, 10000.0, None)
    rope.rebuild("cpu")
    positions = torch.tensor([0, 5, 77, 300, 511])
    qkv = randn(5, 9 + 2 * 3, 64)
    cos, sin = rope.cos_sin[positions].to(BF16).chunk(2, dim=-1)
    cos, sin = torch.cat([cos, cos], -1)[:, None], torch.cat([sin, sin], -1)[:, None]
    x = qkv[:, :12]
    rotated_half = torch.cat([-x[..., 32:], x[..., :32]], dim=-1)
    expected = x * cos + rotated_half * sin
    got = fused.rotary(qkv, 12, fused.rope_for_step(rope.cos_sin, positions, BF16))
    assert torch.equal(got, expected)


@pytest.mark.parametrize("lens,new", [([40, 1, 17], [1, 1, 17]), ([70, 33], [1, 20])])
def test_attention_reads_a_bf16_cache(lens, new):
    """Decodes and prefill chunks over a bf16 cache: the new keys and values are stored as they
    are, and the output is float32 attention over the bf16 values, rounded once."""
    assert cpu_attention.register()
    torch.manual_seed(len(lens))
    heads, kv_heads, dim, bs = 9, 3, 64, 16
    meta = step_meta(lens, new, bs, 64, seed=3)
    tokens = meta.query_start_loc_host[-1]
    qkv = randn(tokens, heads + 2 * kv_heads, dim)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    cache = randn(2, 64, bs, kv_heads, dim)
    got_cache, ref_cache = cache.clone(), cache.float()
    expected = torch_paged_attention(
        q.float().contiguous(),
        k.float().contiguous(),
        v.float().contiguous(),
        ref_cache,
        meta,
        0.125,
    )
    meta.derived.clear()
    got = get_attention_backend(cpu_attention.BACKEND_NAME)(q, k, v, got_cache, meta, 0.125)
    assert got.dtype == BF16
    assert torch.equal(got_cache.float(), ref_cache)  # stored exactly (bf16 in, bf16 kept)
    torch.testing.assert_close(got, expected.to(BF16), rtol=2**-7, atol=2e-3)


def test_mixed_dtypes_are_refused():
    module = load_kernels()
    x = torch.randn(2, 64)
    w = module.pack_linear_weight(torch.randn(64, 64).to(BF16))
    with pytest.raises(RuntimeError, match="share their dtype"):
        module.packed_linear(x, w, None)
    with pytest.raises(RuntimeError, match="float32 or bfloat16 only"):
        module.silu_and_mul(torch.randn(2, 64).half())
