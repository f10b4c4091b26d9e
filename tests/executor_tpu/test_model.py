"""The TPU executor in-process on XLA:CPU against transformers and the GPU executor's runner.

One worker is warmed up for the module (step budget 64 tokens, 8 requests: token buckets
16/32/64, request bucket 8); every test then runs on the precompiled programs, and the last
test asserts from torch_xla's counters that nothing compiled after warm-up.

Logit tolerance: XLA:CPU fuses and reorders the float32 reductions (matmuls of width 576 and
1536, softmax over the context, RMSNorm) differently from torch's CPU kernels, so the
logits are not bit-identical to transformers'. Measured here: at most ~7e-5 on logits of
magnitude ~20 (relative ~4e-6, a few dozen float32 ulps after 30 layers). ``LOGIT_TOL`` = 1e-3,
the GPU executor's tolerance, leaves >10x headroom for other CPUs' vector widths, while a real
error (a wrong position, mask or cache slot) moves logits by more than 0.1.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
pytest.importorskip("torch_xla")


from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import RequestState, ScheduledRow  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import NewRequestData, SamplingParams, StepInput  # noqa: E402
from executor_tpu.compile_watch import CompileStats  # noqa: E402
from executor_tpu.options import TPUOptions  # noqa: E402
from executor_tpu.sampler import VARIANTS  # noqa: E402
from executor_tpu.static_batch import build_static_step, pick_bucket  # noqa: E402
from executor_tpu.worker import TPUWorker  # noqa: E402
from tests.executor_tpu.masks import MaskingRunner, pack  # noqa: E402
from tests.support.mini_controller import (  # noqa: E402
    MODEL_DIR,
    MiniController,
    assert_seeded_sampling_survives_recompute,
    needs_model,
)

BLOCK = 16
LOGIT_TOL = 1e-3
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
MAX_DIFF: dict[str, float] = {}  # measured max |logit difference| per check

pytestmark = needs_model


@pytest.fixture(scope="module")
def tpu(tmp_path_factory):
    cfg = ExecutorConfig(
        model=MODEL_DIR, block_size=BLOCK, seed=7, max_model_len=256, kv_cache_bytes=64 * 2**20
    )
    cache = str(tmp_path_factory.mktemp("xla-cache"))
    worker = TPUWorker(cfg, TPUOptions(compile_cache_dir=cache))
    worker.init_device()
    worker.load_model()
    worker.configure(64, 8, 256)
    worker.warmup = worker.initialize_cache(64)
    return worker


@pytest.fixture(scope="module")
def prompts(hf):
    return [hf.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]


def _hf_logits(hf, ids):
    with torch.inference_mode():
        return hf.model(torch.tensor([ids])).logits[0]


def _hf_generate(hf, ids, n):
    """Greedy continuation of n tokens, not stopping at EOS (as MiniController runs)."""
    with torch.inference_mode():
        out = hf.model.generate(
            torch.tensor([ids]),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def _last_logits(worker, rows):
    """Run rows through the precompiled forward program; last-token logits per row."""
    runner = worker.model_runner
    plan = runner.plan
    step = build_static_step(
        rows,
        pick_bucket(sum(r.num_scheduled for r in rows), plan.token_buckets),
        pick_bucket(len(rows), plan.request_buckets),
        runner.max_blocks,
        BLOCK,
    )
    with torch.no_grad():
        _, _, logits, row_ok = runner.forward_step(step.arrays())
    assert row_ok.cpu()[: len(rows)].all()
    return logits.cpu()[: len(rows)]


def _record(name, diff):
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), diff)
    print(f"{name}: max |logit diff| = {diff:.3g}")
    assert diff < LOGIT_TOL


def test_warmup_compiled_every_shape(tpu):
    seconds, graphs = tpu.warmup
    caps = tpu.describe().capabilities
    assert (caps.token_buckets, caps.request_buckets) == ([16, 32, 64], [8])
    assert (caps.max_tokens_per_step, caps.max_num_seqs, caps.chunked_prefill) == (64, 8, True)
    # Forward per token bucket, prompt logprobs per token bucket, each sampling variant.
    assert graphs == 3 + 3 + len(VARIANTS)
    assert tpu.device_kind == "tpu" and "XLA:CPU" in tpu.device_name
    assert tpu.model_runner.kv_caches[0].shape == (64, BLOCK, 6, 64)
    print(f"warm-up {seconds:.1f}s, {graphs} programs")


def test_logits_match_transformers(tpu, hf, prompts):
    """Chunked prefill across block boundaries, then decodes; two requests batched."""
    p0, p1 = prompts[1], prompts[2]
    extra0, extra1 = [504, 3458, 282], [2683, 17]
    ref0, ref1 = _hf_logits(hf, p0 + extra0), _hf_logits(hf, p1 + extra1)
    s0 = RequestState("r0", list(p0), len(p0), list(range(1, 9)), SamplingParams())
    s1 = RequestState("r1", list(p1), len(p1), list(range(20, 28)), SamplingParams())
    cuts = [0, 7, 23, len(p0)]
    for a, b in zip(cuts, cuts[1:]):  # r0 in three chunks; r1 whole in the last one
        rows = [ScheduledRow(s0, a, b - a, b == len(p0), 0)]
        if b == len(p0):
            rows.append(ScheduledRow(s1, 0, len(p1), True, 0))
        got = _last_logits(tpu, rows)
        _record("chunked prefill", (got[0] - ref0[b - 1]).abs().max().item())
    _record("batched prefill", (got[1] - ref1[len(p1) - 1]).abs().max().item())
    for i in range(2):  # both decode together, different context lengths
        s0.token_ids.append(extra0[i])
        s1.token_ids.append(extra1[i])
        n0, n1 = len(s0.token_ids), len(s1.token_ids)
        got = _last_logits(
            tpu, [ScheduledRow(s0, n0 - 1, 1, True, 0), ScheduledRow(s1, n1 - 1, 1, True, 0)]
        )
        _record(
            "decode",
            max(
                (got[0] - ref0[n0 - 1]).abs().max().item(),
                (got[1] - ref1[n1 - 1]).abs().max().item(),
            ),
        )


def test_greedy_batch_matches_transformers_and_gpu_runner(tpu, hf, prompts):
    from executor_gpu.model_runner import GPUModelRunner

    gpu = GPUModelRunner(
        ExecutorConfig(
            model=MODEL_DIR,
            device="cpu",
            block_size=BLOCK,
            seed=7,
            max_num_batched_tokens=64,
            max_num_seqs=8,
        ),
        load_model_geometry(MODEL_DIR),
    )
    gpu.load_model()
    gpu.initialize_kv_cache(64)
    outputs = {}
    for name, runner in (("tpu", tpu), ("gpu", gpu)):
        runner.reset()
        ctl = MiniController(runner, budget=12)
        reqs = [ctl.add(f"g{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
        ctl.run()
        outputs[name] = [r.output for r in reqs]
    assert len(tpu.model_runner.input_batch) == 0
    assert outputs["tpu"] == outputs["gpu"]
    for out, prompt in zip(outputs["tpu"], prompts):
        assert out == _hf_generate(hf, prompt, 12)


def test_long_prompt_chunked_over_full_steps(tpu, hf, prompts):
    prompt = (prompts[0] + prompts[1] + prompts[2]) * 2  # > 64 tokens: three-plus chunks
    assert len(prompt) > 150
    tpu.reset()
    ctl = MiniController(tpu, budget=64)
    req = ctl.add("long", prompt, max_tokens=12)
    ctl.run()
    assert req.output == _hf_generate(hf, prompt, 12)


def test_logprobs_and_prompt_logprobs_match_transformers(tpu, hf, prompts):
    tpu.reset()
    ctl = MiniController(tpu, budget=10)
    prompt = prompts[2]
    req = ctl.add("lp", prompt, SamplingParams(logprobs=3, prompt_logprobs=2), max_tokens=2)
    ctl.run()
    ref = torch.log_softmax(_hf_logits(hf, prompt + req.output[:1]), dim=-1)
    assert len(req.prompt_logprobs) == len(prompt) - 1
    for i, lp in enumerate(req.prompt_logprobs):
        assert lp.token_id == prompt[i + 1]
        assert abs(lp.logprob - ref[i, prompt[i + 1]].item()) < LOGIT_TOL
        assert lp.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
        assert lp.top_token_ids == ref[i].topk(2).indices.tolist()
    first = req.logprobs[0]
    assert first.token_id == req.output[0] and first.rank == 1  # greedy
    assert first.top_token_ids == ref[len(prompt) - 1].topk(3).indices.tolist()
    assert abs(first.logprob - ref[len(prompt) - 1].max().item()) < LOGIT_TOL


def test_seeded_sampling_survives_recompute(tpu, prompts):
    assert_seeded_sampling_survives_recompute(tpu, prompts[1])  # the "sort" variant (top_p)


def test_every_sampling_variant_runs_precompiled(tpu, prompts):
    """Mixed rows: greedy with logprobs, top-k, penalties, min_tokens, unseeded random."""
    tpu.reset()
    ctl = MiniController(tpu, budget=64)
    eos = 2
    ctl.add("greedy-lp", prompts[0], SamplingParams(logprobs=2), max_tokens=4)
    ctl.add("topk", prompts[1], SamplingParams(temperature=0.9, top_k=20, min_p=0.05), max_tokens=4)
    ctl.add(
        "pen",
        prompts[2],
        SamplingParams(
            temperature=0.7, presence_penalty=1.0, frequency_penalty=0.5, repetition_penalty=1.2
        ),
        max_tokens=4,
    )
    held = ctl.add(
        "min", prompts[0], SamplingParams(min_tokens=3, stop_token_ids=[eos]), max_tokens=4
    )
    ctl.run()
    assert eos not in held.output[:3]
    assert tpu.model_runner.compile_watch.after_warmup == 0


@pytest.mark.parametrize("chunked", [True, False])
def test_the_controller_scheduler_sizes_steps_from_capabilities(tpu, hf, prompts, chunked):
    """The controller's own Scheduler, configured from the runner's capabilities as the engine
    does: with chunked prefill a long prompt spans 64-token steps; without it (the executor's
    --no-chunked-prefill) every prompt is computed whole and a longer one is refused."""
    from controller.core.request import Request
    from controller.core.scheduler import Scheduler, SchedulerConfig

    tpu.config.chunked_prefill = chunked
    try:
        info = tpu.describe()
        caps = info.capabilities
        assert caps.chunked_prefill is chunked and caps.token_buckets == [16, 32, 64]
        sched = Scheduler(
            SchedulerConfig(
                max_num_batched_tokens=min(2048, caps.max_tokens_per_step),
                max_num_seqs=min(128, caps.max_num_seqs),
                chunked_prefill=caps.chunked_prefill,
                block_size=BLOCK,
                num_blocks=64,
                max_model_len=info.model.max_model_len,
            )
        )
        long = prompts[0] + prompts[1] + prompts[2]  # > 64 tokens
        batch = [long, prompts[0]] if chunked else prompts[:2]
        for i, p in enumerate(batch):
            sched.add_request(Request(f"sch{i}", list(p), SamplingParams(), max_tokens=4))
        if not chunked:
            with pytest.raises(ValueError):
                sched.add_request(Request("too-long", list(long), SamplingParams(), 4))
        tpu.reset()
        outputs: dict[str, list[int]] = {}
        partial = 0
        while sched.has_unfinished_requests():
            step = sched.schedule()
            assert 0 < step.num_scheduled_tokens <= 64
            for new in step.new_requests:
                whole = len(new.prompt_token_ids) - new.num_computed_tokens
                partial += new.num_scheduled_tokens < whole
                assert chunked or new.num_scheduled_tokens == whole
            for update in sched.update_from_output(step, tpu.execute_model(step)):
                assert not update.error
                outputs.setdefault(update.request_id, []).extend(update.new_token_ids)
        assert (partial > 0) is chunked
        for i, p in enumerate(batch):
            assert outputs[f"sch{i}"] == _hf_generate(hf, p, 4)
    finally:
        tpu.config.chunked_prefill = True


def test_request_errors_stay_isolated(tpu, prompts):
    tpu.reset()
    ok = NewRequestData("ok", prompts[0][:8], [], SamplingParams(), [1], 0, 8)
    short = NewRequestData("short", prompts[0][:20], [], SamplingParams(), [2], 0, 20)
    bad_tok = NewRequestData("badtok", [1, 10**6], [], SamplingParams(), [3], 0, 2)
    out = tpu.execute_model(StepInput(0, new_requests=[ok, short, bad_tok]))
    by_id = {o.request_id: o for o in out.outputs}
    assert by_id["ok"].sampled_token_id is not None and not by_id["ok"].error
    assert "blocks" in by_id["short"].error and by_id["badtok"].error


def _hf_masked_greedy(hf, ids, allowed, n):
    """Greedy continuation of n tokens, each the best of ``allowed`` under transformers."""
    ids, allowed, out = list(ids), sorted(allowed), []
    for _ in range(n):
        last = _hf_logits(hf, ids)[-1]
        out.append(allowed[int(last[allowed].argmax())])
        ids.append(out[-1])
    return out


def test_masked_steps_run_precompiled(tpu, hf, prompts):
    """Structured output: greedy (with logprobs) and seeded top-p rows within their masks in
    the same steps as unconstrained greedy and top-k rows, over token buckets 64, 32 and 16
    (chunked prefill, then decodes); the masked programs were compiled at warm-up."""
    tpu.reset()
    vocab = tpu.model_runner.geometry.vocab_size
    json_ids, digits = set(range(300, 700)), set(range(30, 60))
    runner = MaskingRunner(tpu, {"json": pack(json_ids, vocab), "seeded": pack(digits, vocab)})
    ctl = MiniController(runner, budget=64)
    constrained = ctl.add("json", prompts[0], SamplingParams(logprobs=3), max_tokens=4)
    free = ctl.add("free", prompts[1], SamplingParams(), max_tokens=4)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=5)
    drawn = ctl.add("seeded", prompts[2], seeded, max_tokens=6)
    ctl.add("topk", prompts[0][:20], SamplingParams(temperature=1.0, top_k=20), max_tokens=3)
    ctl.run()
    assert constrained.output == _hf_masked_greedy(hf, prompts[0], json_ids, 4)
    assert free.output == _hf_generate(hf, prompts[1], 4)
    assert set(drawn.output) <= digits
    first = constrained.logprobs[0]
    want = _hf_logits(hf, prompts[0])[-1][sorted(json_ids)].log_softmax(-1)
    assert set(first.top_token_ids) <= json_ids and len(first.top_token_ids) == 3
    assert first.rank == 1 and abs(first.logprob - want.max().item()) < LOGIT_TOL
    assert tpu.model_runner.compile_watch.after_warmup == 0


def test_no_compilation_after_warmup(tpu):
    """Every step above ran on programs compiled during warm-up (torch_xla's counter)."""
    watch = tpu.model_runner.compile_watch
    assert watch.baseline is not None
    assert CompileStats.now().count == watch.baseline.count
    assert watch.check("the module's steps") == 0 and watch.after_warmup == 0
    print(f"max |logit diff| per check: {MAX_DIFF}")
