"""The one-pass logits scan (executor_gpu/cpu/logits_scan.cpp): each row's argmax is torch's
(the first index of the maximum) and its finiteness flag is ``row.sum().isfinite()``'s, on any
vocabulary size, row stride and number of threads."""

from __future__ import annotations

import pytest
import torch

from executor_gpu.cpu.kernels import load_kernels

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")


def _check(logits: torch.Tensor) -> None:
    argmax, finite = load_kernels().scan_logits(logits)
    ok = logits.sum(dim=-1).isfinite()
    assert torch.equal(finite, ok)
    assert argmax.dtype == torch.int64 and finite.dtype == torch.bool
    rows = ok.nonzero()[:, 0]  # a non-finite row's argmax is of no use (its request fails)
    assert torch.equal(argmax[rows], logits[rows].argmax(dim=-1))


@pytest.mark.parametrize("vocab", [1, 5, 16, 17, 31, 100, 49152, 49157])
@pytest.mark.parametrize("rows", [0, 1, 3, 64])
def test_argmax_and_finiteness_match_torch(threads, vocab, rows):
    g = torch.Generator().manual_seed(vocab * 131 + rows)
    logits = torch.randn(rows, vocab, generator=g) * 4
    for n in (1, 2):
        threads(n)
        _check(logits)


def test_ties_take_the_first_maximum():
    vocab = 1000
    logits = torch.zeros(8, vocab)
    spots = [(0, [3, 4]), (1, [999, 20]), (2, [16, 32, 48]), (3, [15, 31]), (4, [998, 999])]
    for r, cols in spots:
        logits[r, cols] = 5.0
    logits[5] = -1.0  # all equal: index 0
    logits[6, 17] = logits[6, 1] = 2.0  # different lanes, the later lane holds the first max
    logits[7, 33] = logits[7, 2] = 2.0
    _check(logits)
    assert load_kernels().scan_logits(logits)[0].tolist()[:6] == [3, 20, 16, 15, 998, 0]


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")])
@pytest.mark.parametrize("col", [0, 7, 16, 4095, 4099])  # head, first vector, body, tail
def test_a_non_finite_value_anywhere_flags_its_row_alone(bad, col):
    logits = torch.randn(4, 4100, generator=torch.Generator().manual_seed(col))
    logits[2, col] = bad
    argmax, finite = load_kernels().scan_logits(logits)
    assert finite.tolist() == [True, True, False, True]
    _check(logits)


def test_strided_rows_are_read_in_place():
    base = torch.randn(6, 300, generator=torch.Generator().manual_seed(3))
    view = base[:, 10:250]  # rows 300 apart, each contiguous
    assert not view.is_contiguous()
    _check(view)
    every_other = base[::2]
    _check(every_other)


def test_rejects_what_it_cannot_read():
    m = load_kernels()
    with pytest.raises(RuntimeError):
        m.scan_logits(torch.randn(4, 10).t())  # columns not contiguous
    with pytest.raises(RuntimeError):
        m.scan_logits(torch.randn(4, 10, dtype=torch.float64))
    with pytest.raises(RuntimeError):
        m.scan_logits(torch.randn(10))
