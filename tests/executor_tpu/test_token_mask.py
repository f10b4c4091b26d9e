"""Allowed-token masks in the TPU executor's static sampler, on plain CPU torch (no XLA, no
model): packing, greedy and random sampling within the mask, constrained logprobs, mixed steps
of masked and unmasked rows, penalties and filters with a mask."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common.wire.step_types import SamplingParams  # noqa: E402
from executor_tpu.sampler import (  # noqa: E402
    VARIANTS,
    SampleVariant,
    build_sampling_inputs,
    sample,
    unpack_logprobs,
)
from executor_tpu.token_mask import allowed_tokens, mask_words  # noqa: E402
from tests.executor_tpu import masks  # noqa: E402

V = 300  # above CANDIDATES: "topk" and "sort" differ; not a multiple of 32 (a partial word)


def pack(tokens) -> bytes:
    return masks.pack(tokens, V)


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _run(logits, params, masks, keys=None, tokens=None, variant=None):
    n, bucket = len(params), logits.shape[0]
    tokens = tokens or [[1, 2, 3]] * n
    inp = build_sampling_inputs(
        params,
        tokens,
        [len(t) for t in tokens],
        bucket,
        V,
        16,
        5,
        keys or list(range(n)),
        variant,
        masks,
    )
    d = {k: torch.from_numpy(v) for k, v in inp.arrays().items()}
    ok = torch.ones(bucket, dtype=torch.bool)
    return sample(logits, ok, d, inp.variant, 5), inp


def test_packing_round_trip():
    allowed = {0, 31, 32, 33, 255, 299}
    words = mask_words([pack(allowed), None], 4, V)
    assert words.shape == (4, (V + 31) // 32) and words.dtype == np.int32
    got = allowed_tokens(torch.from_numpy(words), V)
    assert set(torch.nonzero(got[0])[:, 0].tolist()) == allowed
    assert got[1:].all()  # unconstrained and padding rows allow everything


def test_masked_variants_are_warmed_and_chosen():
    assert len(VARIANTS) == 12 and sum(v.masked for v in VARIANTS) == 6
    _, inp = _run(_logits(2), [SamplingParams()] * 2, [None, None])
    assert inp.variant == SampleVariant("greedy", False) and inp.allowed is None
    _, inp = _run(_logits(2), [SamplingParams()] * 2, [pack({3}), None])
    assert inp.variant == SampleVariant("greedy", False, True) and inp.allowed.shape == (2, 10)


def test_greedy_picks_the_best_allowed_token():
    logits = _logits(4, seed=1)
    allowed = [set(range(0, V, 7)), {5}, None]
    out, _ = _run(logits, [SamplingParams()] * 3, [pack(a) if a else None for a in allowed])
    best = [max(allowed[0], key=lambda t: logits[0, t]), 5, int(logits[2].argmax())]
    assert out[:3, 0].long().tolist() == best
    assert out[:, 1].all()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=1.0, top_k=4, seed=3),
        SamplingParams(temperature=0.8, top_p=0.9, seed=3),
        SamplingParams(temperature=1.0, min_p=0.1, seed=3),
        SamplingParams(temperature=1.0, presence_penalty=0.5, repetition_penalty=1.3, seed=3),
    ],
)
def test_random_rows_only_draw_allowed_tokens(params):
    """Seeded rows over many positions, every variant kind (topk, sort, adjust)."""
    logits = _logits(1, seed=2).expand(64, V).contiguous()
    allowed = {2, 3, 40, 41, 150, 299}  # few and mostly unlikely
    tokens = [[1] * (4 + i) for i in range(64)]  # distinct positions: distinct seeded keys
    out, _ = _run(logits, [params] * 64, [pack(allowed)] * 64, tokens=tokens)
    drawn = out[:, 0].long().tolist()
    assert set(drawn) <= allowed and len(set(drawn)) > 1
    again, _ = _run(logits, [params] * 64, [pack(allowed)] * 64, tokens=tokens)
    assert torch.equal(out[:, 0], again[:, 0])  # seeded: the same draws


def test_logprobs_are_of_the_constrained_distribution():
    logits = _logits(2, seed=4)
    allowed = {7, 8, 9}
    out, inp = _run(
        logits, [SamplingParams(logprobs=5), SamplingParams(logprobs=5)], [pack(allowed), None]
    )
    lp = unpack_logprobs(out[0, 2:].numpy(), int(out[0, 0]), 5)
    want = logits[0, sorted(allowed)].log_softmax(-1)
    assert lp.token_id in allowed and lp.rank == 1
    assert abs(lp.logprob - float(want.max())) < 1e-5
    assert set(lp.top_token_ids) == allowed and len(lp.top_logprobs) == 3  # never disallowed ones
    assert np.isclose(np.exp(lp.top_logprobs).sum(), 1.0, atol=1e-5)
    free = unpack_logprobs(out[1, 2:].numpy(), int(out[1, 0]), 5)  # the unmasked row: unchanged
    assert free.top_token_ids == logits[1].topk(5).indices.tolist()


def test_mixed_step_leaves_unmasked_rows_unchanged():
    logits = _logits(8, seed=5)
    params = [SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.7)] * 2
    masks = [pack({1, 2}), None, None, pack(range(100, 200))]
    out, inp = _run(logits, params, masks, keys=[11, 12, 13, 14])
    plain, plain_inp = _run(logits, params, [None] * 4, keys=[11, 12, 13, 14])
    assert inp.variant.masked and not plain_inp.variant.masked
    assert out[1:3, 0].tolist() == plain[1:3, 0].tolist()
    assert int(out[0, 0]) in {1, 2} and 100 <= int(out[3, 0]) < 200


def test_a_mask_allowing_nothing_fails_the_row():
    out, _ = _run(_logits(2, seed=6), [SamplingParams()] * 2, [pack(set()), None])
    assert out[:, 1].tolist() == [0.0, 1.0]


def test_unpacking_on_xla_matches_every_bit():
    """Words with bit 31 set (negative int32) included: XLA's shifts of those lost bits."""
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    torch_xla = pytest.importorskip("torch_xla")
    allowed = [{0, 31, 32, 63, 64, 299}, set(range(0, V, 3)), set(range(32, 64)), set()]
    words = mask_words([pack(a) for a in allowed], 4, V)
    got = allowed_tokens(torch.from_numpy(words).to(torch_xla.device()), V).cpu()
    for row, want in zip(got, allowed):
        assert set(torch.nonzero(row)[:, 0].tolist()) == want


def test_a_grammar_allowing_only_a_stop_wins_over_min_tokens():
    params = [
        SamplingParams(min_tokens=5, stop_token_ids=[9]),
        SamplingParams(min_tokens=5, stop_token_ids=[9]),
    ]
    out, inp = _run(_logits(2, seed=7), params, [pack({9}), pack({9, 10})])
    assert inp.variant.adjust and inp.variant.masked
    assert out[:, 0].long().tolist() == [9, 10] and out[:, 1].all()


def test_a_zero_noise_draw_never_picks_a_masked_token():
    """One allowed token of probability 1 whose noise draw is exactly 0 (E = inf): it still
    wins over the masked tokens (all of probability 0) in the full-vocabulary race."""
    from executor_tpu import sampler

    logits = _logits(1, seed=8)
    real = sampler.hash_uniform
    try:
        sampler.hash_uniform = lambda keys, ids: torch.where(ids == 77, 0.0, real(keys, ids))
        out, inp = _run(logits, [SamplingParams(temperature=1.0)], [pack({77})])
    finally:
        sampler.hash_uniform = real
    assert inp.variant.kind == "topk" and int(out[0, 0]) == 77


def test_masked_sampling_compiles_once_per_request_bucket_on_xla():
    """Any masks (none, some rows, every row, other tokens) and parameters in two request
    buckets run on the programs their first step compiled (the model-level test covers the
    token buckets, with one request bucket)."""
    import os

    os.environ.setdefault("PJRT_DEVICE", "CPU")
    torch_xla = pytest.importorskip("torch_xla")
    import torch_xla.core.xla_model as xm

    from executor_tpu.compile_watch import CompileStats

    device = torch_xla.device()
    greedy, top_k = SamplingParams(logprobs=2), SamplingParams(temperature=1.0, top_k=9, seed=1)

    def step(bucket, params, masks, variant):
        inp = build_sampling_inputs(
            params, [[1, 2]] * len(params), [2] * len(params), bucket, V, 16, 5,
            list(range(len(params))), variant, masks,
        )  # fmt: skip
        arrays = inp.arrays()
        moved = xm.send_cpu_data_to_device([torch.from_numpy(a) for a in arrays.values()], device)
        logits = torch.from_numpy(_logits(bucket).numpy()).to(device)
        ok = torch.ones(bucket, dtype=torch.bool, device=device)
        out = sample(logits, ok, dict(zip(arrays, moved)), inp.variant, 5)
        torch_xla.sync()
        return out.cpu(), inp.variant

    kinds = [SampleVariant("greedy", False), SampleVariant("topk", False, True)]
    for bucket in (2, 4):  # warm: one step per (bucket, variant)
        for v in kinds:
            step(bucket, [greedy], [pack({1})] if v.masked else None, v)
    baseline = CompileStats.now().count
    for bucket in (2, 4):
        out, v = step(bucket, [greedy, top_k], [pack({5, 6}), None], None)
        assert v == kinds[1] and int(out[0, 0]) in {5, 6}
        out, v = step(bucket, [top_k, top_k], [pack({7}), pack(range(100, 300))], None)
        assert int(out[0, 0]) == 7 and 100 <= int(out[1, 0]) < 300
        out, v = step(bucket, [greedy, greedy], [None, None], kinds[1])  # masked, none given
        assert torch.isfinite(out[:2, 2]).all()
        out, v = step(bucket, [SamplingParams()] * 2, None, None)
        assert v == kinds[0]
    assert CompileStats.now().count == baseline
