"""The TPU executor's static-shape pieces on plain CPU torch (no XLA, no model): buckets, padded
step inputs, KV layouts, and the static sampler against common.torch.sampling's semantics."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from common.torch.input_batch import RequestState, ScheduledRow  # noqa: E402
from common.torch.sampling import (  # noqa: E402
    apply_filters,
    apply_penalties,
    build_sampling_metadata,
    compute_logprobs,
)
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_tpu.attention import kernel_layout, plain_layout  # noqa: E402
from executor_tpu.sampler import (  # noqa: E402
    CANDIDATES,
    SampleVariant,
    adjust_logits,
    build_sampling_inputs,
    choose_variant,
    hash_uniform,
    sample,
    token_logprobs,
    truncate,
    unpack_logprobs,
)
from executor_tpu.static_batch import (  # noqa: E402
    build_static_step,
    pick_bucket,
    plan_buckets,
)

V = 300  # above CANDIDATES, so "topk" and "sort" differ


# --- buckets and padded steps ----------------------------------------------------------------


def test_default_buckets_and_pairs():
    plan = plan_buckets(64, 8)
    assert (plan.token_buckets, plan.request_buckets) == ([16, 32, 64], [8])
    assert (plan.max_tokens, plan.max_seqs) == (64, 8)
    assert plan.pairs() == [(16, 8), (32, 8), (64, 8)]
    plan = plan_buckets(48, 20)
    assert (plan.token_buckets, plan.request_buckets) == ([16, 32, 48], [8, 16, 20])
    # A step of 16 tokens has at most 16 requests: (16, 20) is never needed.
    assert (16, 20) not in plan.pairs() and (16, 16) in plan.pairs() and (48, 20) in plan.pairs()
    assert plan_buckets(4, 2).token_buckets == [4] and plan_buckets(4, 2).request_buckets == [2]
    plan = plan_buckets(64, 128)  # never more requests than tokens in a step
    assert plan.request_buckets == [8, 16, 32, 64] and plan.max_seqs == 64
    assert {r for _, r in plan.pairs()} == set(plan.request_buckets)


def test_configured_buckets_cap_the_step():
    plan = plan_buckets(2048, 128, token_buckets=[64, 16, 32], request_buckets=[8])
    assert plan.token_buckets == [16, 32, 64] and plan.request_buckets == [8]
    assert (plan.max_tokens, plan.max_seqs) == (64, 8)  # what the scheduler is told
    plan = plan_buckets(48, 8, token_buckets=[64])
    assert plan.token_buckets == [64] and plan.max_tokens == 48
    assert pick_bucket(17, [16, 32]) == 32
    with pytest.raises(ValueError):
        pick_bucket(33, [16, 32])


def _row(rid, tokens, blocks, computed, scheduled, prompt_lps=0, num_prompt=None):
    state = RequestState(
        rid, list(tokens), num_prompt or len(tokens), list(blocks), SamplingParams()
    )
    return ScheduledRow(state, computed, scheduled, computed + scheduled == len(tokens), prompt_lps)


def test_static_step_padding():
    a = _row("a", range(100, 105), [7], 4, 1)  # a decode at position 4
    b = _row("b", range(200, 220), [3, 9], 0, 18, prompt_lps=18)  # a prefill chunk
    step = build_static_step([a, b], 32, 8, max_blocks=4, block_size=16)
    assert (step.token_bucket, step.request_bucket, step.num_tokens) == (32, 8, 19)
    assert step.input_ids[:19].tolist() == [104] + list(range(200, 218))
    assert step.input_ids[19:].tolist() == [0] * 13
    assert step.positions[:3].tolist() == [4, 0, 1] and step.positions[19:].max() == 0
    # Slots: block * 16 + offset; padding tokens write slot 0 of the null block.
    assert step.slot_mapping[0] == 7 * 16 + 4
    assert step.slot_mapping[1:19].tolist() == [3 * 16 + i for i in range(16)] + [144, 145]
    assert step.slot_mapping[19:].tolist() == [0] * 13
    assert step.token_rows.tolist() == [0] + [1] * 18 + [8] * 13  # padding -> spare row 8
    assert step.block_tables.shape == (9, 4)
    assert step.block_tables[:2].tolist() == [[7, 0, 0, 0], [3, 9, 0, 0]]
    assert not step.block_tables[2:].any()
    assert step.seq_lens.tolist() == [5, 18] + [0] * 6
    assert step.query_start_loc.tolist() == [0, 1, 19] + [19] * 6
    assert step.num_seqs.tolist() == [2]
    assert step.logits_indices.tolist() == [0, 18] + [0] * 6
    assert step.prompt_lp_targets[1:19].tolist() == list(range(201, 219))
    assert step.prompt_lp_targets[0] == 0 and not step.prompt_lp_targets[19:].any()
    with pytest.raises(ValueError):
        build_static_step([a, b], 16, 8, max_blocks=4, block_size=16)  # 19 tokens > 16
    with pytest.raises(ValueError):
        build_static_step([b], 32, 8, max_blocks=1, block_size=16)  # table too narrow


def test_kv_layouts():
    assert not plain_layout(3, 64).padded
    smol = kernel_layout(3, 64, 4)  # 6 combined heads do not tile: 4 kv heads, 128 wide
    assert (smol.padded_kv_heads, smol.padded_head_dim) == (4, 128) and smol.padded
    assert smol.shape(10, 16) == (10, 16, 8, 128)
    assert kernel_layout(8, 128, 2).padded is False  # 16 bf16 heads = 8 words
    assert kernel_layout(1, 128, 2).padded_kv_heads == 1  # 2 bf16 heads = 1 word
    assert kernel_layout(3, 128, 2).padded_kv_heads == 4


# --- sampling ---------------------------------------------------------------------------------


def _logits(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * 3


def _inputs(params, tokens=None, num_prompt=None, bucket=None, keys=None, variant=None):
    n = len(params)
    tokens = tokens or [[1, 2, 3]] * n
    inp = build_sampling_inputs(
        params,
        tokens,
        num_prompt or [len(t) for t in tokens],
        bucket or n,
        V,
        16,
        5,
        keys or list(range(n)),
        variant,
    )
    d = {k: torch.from_numpy(v) for k, v in inp.arrays().items()}
    return inp, d


def _run(logits, params, **kw):
    inp, d = _inputs(params, bucket=logits.shape[0], **kw)
    ok = torch.ones(logits.shape[0], dtype=torch.bool)
    return sample(logits, ok, d, inp.variant, 5), inp


def test_variant_choice():
    g, r = SamplingParams(), SamplingParams(temperature=1.0)
    assert choose_variant([g, g], V, [0, 0]) == SampleVariant("greedy", False)
    assert choose_variant([g, SamplingParams(logprobs=2)], V, [0, 0]).kind == "topk"
    assert choose_variant([g, r], V, [0, 0]).kind == "topk"
    assert (
        choose_variant([SamplingParams(temperature=1.0, top_k=50, top_p=0.5)], V, [0]).kind
        == "topk"
    )
    assert choose_variant([SamplingParams(temperature=1.0, top_p=0.5)], V, [0]).kind == "sort"
    assert (
        choose_variant([SamplingParams(temperature=1.0, top_k=CANDIDATES + 1)], V, [0]).kind
        == "sort"
    )
    assert choose_variant([SamplingParams(presence_penalty=0.5)], V, [0]).adjust
    stop = SamplingParams(min_tokens=3, stop_token_ids=[2])
    assert choose_variant([stop], V, [2]).adjust and not choose_variant([stop], V, [3]).adjust


def test_greedy_rows_and_padding():
    logits = _logits(8)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=1), SamplingParams()]
    out, inp = _run(logits, params)
    assert inp.variant.kind == "topk" and out.shape == (8, 4 + 10)
    assert out[:3, 0].long().tolist() == logits[:3].argmax(-1).tolist()
    greedy, _ = _run(logits, [SamplingParams()] * 3)
    assert greedy.shape == (8, 2) and greedy[:, 0].long().tolist() == logits.argmax(-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=7),
        SamplingParams(temperature=0.8, top_p=0.6),
        SamplingParams(temperature=1.3, top_k=40, top_p=0.7),
        SamplingParams(temperature=1.0, min_p=0.2),
        SamplingParams(temperature=1.0, top_k=5, min_p=0.5),
        SamplingParams(temperature=1.0, top_p=0.95),
    ],
)
def test_filters_match_common_sampling(params):
    """The candidates kept equal common.torch.sampling.apply_filters's, for both kinds that
    apply."""
    x = _logits(6, seed=3) / params.temperature
    n = x.shape[0]
    top_k = torch.full((n,), params.top_k)
    top_p = torch.full((n,), params.top_p)
    min_p = torch.full((n,), params.min_p)
    ref = apply_filters(
        x,
        top_k if params.top_k else None,
        top_p if params.top_p < 1 else None,
        min_p if params.min_p else None,
    )
    kinds = ["sort"] if choose_variant([params], V, [0]).kind == "sort" else ["topk", "sort"]
    for kind in kinds:
        vals, ids = truncate(x, top_k, top_p, min_p, kind)
        if kind == "topk" and not (params.top_k or params.top_p < 1):
            continue  # untruncated rows race over the whole vocabulary instead
        for row in range(n):
            kept = set(ids[row][vals[row].isfinite()].tolist())
            assert kept == set(torch.nonzero(ref[row].isfinite())[:, 0].tolist()), (kind, row)


def test_samples_stay_in_the_filtered_set_and_vary():
    logits = _logits(1, seed=4).expand(64, V).contiguous()
    params = [SamplingParams(temperature=1.0, top_k=6)] * 64
    out, _ = _run(logits, params, keys=list(range(1000, 1064)))
    allowed = set(logits[0].topk(6).indices.tolist())
    drawn = out[:, 0].long().tolist()
    assert set(drawn) <= allowed and len(set(drawn)) > 2


def test_race_follows_the_distribution():
    """Across many noise keys, the exponential race draws tokens with their probabilities."""
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-30.0] * (V - 3)]).expand(4000, V).contiguous()
    params = [SamplingParams(temperature=1.0)] * 4000
    out, _ = _run(logits, params, keys=[k * 7919 + 13 for k in range(4000)])
    counts = np.bincount(out[:, 0].long().numpy(), minlength=3)[:3] / 4000
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]), 0).numpy()
    assert np.abs(counts - expected).max() < 0.03, (counts, expected)


def test_seeded_noise_depends_on_seed_and_position_only():
    logits = _logits(3, seed=5)
    p = SamplingParams(temperature=1.0, seed=42)
    a, _ = _run(logits, [p] * 3, tokens=[[1] * 10] * 3)
    b, _ = _run(logits, [p] * 3, tokens=[[1] * 10] * 3, keys=[7, 8, 9])  # unseeded keys unused
    assert torch.equal(a[:, 0], b[:, 0])
    u = hash_uniform(torch.tensor([3, 4]), torch.arange(V).expand(2, V))
    assert (u >= 0).all() and (u < 1).all() and abs(u.mean().item() - 0.5) < 0.05
    assert not torch.equal(u[0], u[1])


def test_penalties_and_min_tokens_match_common_sampling():
    logits = _logits(3, seed=6)
    params = [
        SamplingParams(presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
        SamplingParams(min_tokens=5, stop_token_ids=[4, 9]),
        SamplingParams(),
    ]
    prompts, outputs = [[1, 2, 3, 3], [5], [6]], [[3, 7, 7, 8], [9], [1]]
    tokens = [p + o for p, o in zip(prompts, outputs)]
    inp, d = _inputs(params, tokens=tokens, num_prompt=[len(p) for p in prompts])
    assert inp.variant.adjust
    got = adjust_logits(logits, d)
    meta = build_sampling_metadata(
        params,
        [len(t) for t in tokens],
        prompts,
        outputs,
        V,
        "cpu",
        num_outputs=[len(o) for o in outputs],
    )
    want = apply_penalties(logits, meta).clone()
    want[meta.suppress_rows, meta.suppress_ids] = float("-inf")
    assert torch.allclose(got, want, atol=1e-6)
    assert torch.isinf(got[1, [4, 9]]).all() and torch.equal(got[2], logits[2])


def test_logprobs_match_common_sampling():
    logits = _logits(4, seed=7)
    tokens = torch.tensor([0, 5, 9, 299])
    packed = token_logprobs(logits, tokens, 5)
    ref = compute_logprobs(logits, tokens, 5)
    for i in range(4):
        lp = unpack_logprobs(packed[i].numpy(), int(tokens[i]), 3)
        assert lp.rank == int(ref.ranks[i]) and abs(lp.logprob - float(ref.logprobs[i])) < 1e-5
        assert lp.top_token_ids == ref.top_ids[i, :3].tolist()
        assert np.allclose(lp.top_logprobs, ref.top_logprobs[i, :3].numpy(), atol=1e-5)


# --- command line -----------------------------------------------------------------------------


def test_command_line_and_device_choice(monkeypatch):
    import subprocess
    import sys

    from executor_tpu.options import resolve_cache_dir, select_pjrt_device
    from tests.support.processes import ROOT

    out = subprocess.run(
        [sys.executable, "-m", "executor_tpu", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    for flag in (
        "--token-buckets",
        "--request-buckets",
        "--compile-cache-dir",
        "--attention",
        "--no-chunked-prefill",
        "--metrics-port",
    ):
        assert flag in out
    monkeypatch.setenv("PJRT_DEVICE", "CPU")
    assert select_pjrt_device("tpu") == "CPU"  # the environment wins
    monkeypatch.delenv("PJRT_DEVICE")
    assert select_pjrt_device("cpu") == "CPU"
    monkeypatch.delenv("PJRT_DEVICE")
    with pytest.raises(ValueError):
        select_pjrt_device("cuda")
    assert resolve_cache_dir("auto", "CPU") == "" and resolve_cache_dir("auto", "TPU")
    assert resolve_cache_dir("/x", "CPU") == "/x"
