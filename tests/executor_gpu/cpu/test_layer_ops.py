"""The fused CPU layer ops (executor_gpu/cpu/layer_ops.cpp) against the torch reference."""

from __future__ import annotations

import os

import pytest
import torch

from common.torch.models import build_model
from common.torch.models.layer_ops import TORCH_LAYER_OPS as REF
from executor_gpu.cpu.kernels import load_kernels
from executor_gpu.cpu.layer_ops import layer_ops

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")

MODEL_DIR = os.environ.get(
    "TANDEM_MODEL_DIR", os.path.expanduser("~/.cache/tandem/models/SmolLM2-135M-Instruct")
)
# Row counts on one thread (decode-sized) and split across threads (past the threshold).
ROWS = [1, 7, 64, 700]


@pytest.fixture(scope="module")
def fused():
    return layer_ops()


@pytest.mark.parametrize("rows", ROWS)
def test_rms_norm_and_residual_add(fused, rows):
    torch.manual_seed(rows)
    x, res = torch.randn(rows, 576) * 3, torch.randn(rows, 576)
    w = torch.randn(576)
    torch.testing.assert_close(
        fused.rms_norm(x, w, 1e-5), REF.rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5
    )
    r_ref, r_got = res.clone(), res.clone()
    expected = REF.add_rms_norm(x, r_ref, w, 1e-5)
    got = fused.add_rms_norm(x, r_got, w, 1e-5)
    assert torch.equal(r_got, r_ref)  # the residual stream is updated in place, exactly
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 5, 6, 16, 64, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear(fused, rows, bias):
    """Weights packed into column panels give x @ w + b, for decode and prefill batch sizes."""
    torch.manual_seed(rows)
    w = torch.randn(96, 192) * 0.1
    b = torch.randn(192) if bias else None
    x = torch.randn(rows, 96)
    packed = fused.prepare_linear(w)
    assert packed.dim() == 3 and packed.numel() == w.numel()
    expected = x @ w + (b if bias else 0)
    torch.testing.assert_close(fused.linear(x, packed, b), expected, rtol=1e-5, atol=1e-5)
    wide = torch.randn(rows, 200)  # rows of a wider tensor
    torch.testing.assert_close(
        fused.linear(wide[:, 7:103], packed, b),
        REF.linear(wide[:, 7:103].contiguous(), w, b),
        rtol=1e-5,
        atol=1e-5,
    )


def test_linear_without_whole_panels_stays_unpacked(fused):
    w = torch.randn(32, 72)  # 72 output columns: not whole 64-column panels
    assert fused.prepare_linear(w) is w
    x = torch.randn(3, 32)
    torch.testing.assert_close(fused.linear(x, w, None), x @ w)


def test_rms_norm_reads_strided_rows(fused):
    base = torch.randn(5, 1000)
    x = base[:, 100:676]  # rows of a wider tensor
    w = torch.rand(576)
    torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), REF.rms_norm(x.contiguous(), w, 1e-6))


@pytest.mark.parametrize("rows", ROWS)
def test_silu_and_mul(fused, rows):
    torch.manual_seed(rows)
    gate_up = torch.randn(rows, 2 * 1536) * 6
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0])  # past the exp clamp
    torch.testing.assert_close(
        fused.silu_and_mul(gate_up), REF.silu_and_mul(gate_up), rtol=2e-6, atol=1e-6
    )


def test_non_finite_values_propagate(fused):
    x = torch.randn(3, 64)
    x[1, 5] = float("nan")
    assert fused.rms_norm(x, torch.ones(64), 1e-6)[1].isnan().all()
    gate_up = torch.randn(3, 128)
    gate_up[2, 3] = float("nan")
    assert fused.silu_and_mul(gate_up)[2, 3].isnan()
    assert fused.silu_and_mul(gate_up)[:2].isfinite().all()


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("dim", [64, 128])
def test_rotary_rotates_queries_and_keys_in_place(fused, rows, dim):
    torch.manual_seed(dim + rows)
    table = torch.randn(4096, dim)
    positions = torch.randint(0, 4096, (rows,))
    qkv = torch.randn(rows, 9 + 3 + 3, dim)
    expected = REF.rotary(qkv, 12, REF.rope_for_step(table, positions, torch.float32))
    inplace = qkv.clone()
    got = fused.rotary(inplace, 12, fused.rope_for_step(table, positions, torch.float32))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert got.data_ptr() == inplace.data_ptr()  # a view of the rotated qkv
    assert torch.equal(inplace[:, 12:], qkv[:, 12:])  # values untouched


def test_rotary_rejects_positions_past_the_table(fused):
    table = torch.randn(8, 64)
    with pytest.raises(RuntimeError, match="out of range"):
        fused.rotary(torch.randn(2, 3, 64), 2, (table, torch.tensor([3, 8])))


@pytest.mark.skipif(
    not os.path.exists(os.path.join(MODEL_DIR, "config.json")), reason="default model not found"
)
def test_model_with_fused_ops_matches_torch_ops(fused):
    """A whole prefill of the default model: same hidden states (within float32 rounding) and
    the same greedy token at every position."""
    from common.torch.attention import AttentionMetadata

    model = build_model(MODEL_DIR, torch.float32, "cpu")
    ids = torch.tensor([1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3714, 282, 30])
    n = ids.numel()
    meta = AttentionMetadata(
        slot_mapping=torch.arange(n),
        query_start_loc=torch.tensor([0, n]),
        seq_lens=torch.tensor([n]),
        block_tables=torch.zeros(1, 1, dtype=torch.long),
        block_size=16,
        num_decodes=0,
        max_decode_seq_len=0,
        query_start_loc_host=[0, n],
        seq_lens_host=[n],
    )
    with torch.inference_mode():
        expected = model(ids, torch.arange(n), meta)
        model.set_layer_ops(fused)
        got = model(ids, torch.arange(n), meta)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
        assert torch.equal(
            model.compute_logits(got).argmax(-1), model.compute_logits(expected).argmax(-1)
        )


def test_logits_over_the_packed_output_embedding(fused):
    torch.manual_seed(5)
    embedding = torch.randn(256, 96)  # [vocab, hidden]
    prepared = fused.prepare_logits(embedding)
    assert prepared.dim() == 3 and prepared.data_ptr() != embedding.data_ptr()
    for rows in (1, 7, 40):
        hidden = torch.randn(rows, 96)
        torch.testing.assert_close(
            fused.logits(hidden, prepared), REF.logits(hidden, embedding), rtol=1e-5, atol=1e-5
        )
    odd = torch.randn(100, 96)  # a vocabulary of no whole panels stays as it is
    assert fused.prepare_logits(odd) is odd
