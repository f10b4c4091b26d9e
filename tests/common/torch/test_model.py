"""The executor's model and GPU model runner against transformers (CPU, float32).

Tests on the default model are skipped when its directory is absent; tests on tiny random
checkpoints (other architectures and checkpoint layouts) always run.
"""

from __future__ import annotations

import pytest

from tests.support.mini_controller import (
    BLOCK,
    MODEL_DIR,
    MiniController,
    assert_seeded_sampling_survives_recompute,
    needs_model,
)

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import InputBatch, RequestState, ScheduledRow  # noqa: E402
from common.torch.models import build_model  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import CachedRequestData, NewRequestData, SamplingParams, StepInput  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402
from executor_gpu.worker import GPUWorker  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
LOGIT_TOL = 1e-3
MAX_DIFF: dict[str, float] = {}  # test name -> measured max |logit difference|


@pytest.fixture(scope="module")
def hf_model():
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def prompts():
    tok = transformers.AutoTokenizer.from_pretrained(MODEL_DIR)
    out = []
    for text in PROMPTS:
        ids = tok.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True
        )
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def model():
    return build_model(MODEL_DIR, torch.float32, "cpu")


def _fresh_cache(model, num_blocks=64):
    args = model.args
    caches = [
        torch.zeros(2, num_blocks, BLOCK, args.num_kv_heads, args.head_dim)
        for _ in range(args.num_layers)
    ]
    model.bind_kv_cache(caches)


def _hf_logits(hf_model, ids):
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0]


def _forward(model, batch_rows):
    """Run rows [(state, computed, scheduled)] in one step; logits of every token, per row."""
    ib = InputBatch(BLOCK, model.args.vocab_size, 8192, "cpu")
    rows = [ScheduledRow(s, c, n, c + n == len(s.token_ids), 0) for s, c, n in batch_rows]
    rows.sort(key=lambda r: r.num_scheduled != 1)
    batch = ib.build(rows)
    with torch.inference_mode():
        logits = model.compute_logits(model(batch.input_ids, batch.positions, batch.attn))
    qsl = batch.attn.query_start_loc_host
    return {r.state.request_id: logits[qsl[i] : qsl[i + 1]] for i, r in enumerate(rows)}


def _state(rid, ids, first_block):
    blocks = list(range(first_block, first_block + 8))
    return RequestState(rid, list(ids), len(ids), blocks, SamplingParams())


def _record(name, diff):
    MAX_DIFF[name] = max(MAX_DIFF.get(name, 0.0), diff)
    print(f"{name}: max |logit diff| = {diff:.3g}")
    assert diff < LOGIT_TOL


@needs_model
def test_geometry():
    g = load_model_geometry(MODEL_DIR, max_model_len=4096, served_name="smol")
    assert (g.model_name, g.architecture, g.vocab_size) == ("smol", "LlamaForCausalLM", 49152)
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.max_model_len) == (30, 3, 64, 4096)
    assert 2 in g.eos_token_ids


@needs_model
def test_prefill_then_decode_matches_hf(model, hf_model, prompts):
    prompt = prompts[0]
    extra = [504, 3458, 282, 4649, 314]  # arbitrary continuation tokens
    ref = _hf_logits(hf_model, prompt + extra)
    _fresh_cache(model)
    state = _state("a", prompt, 1)
    ours = [_forward(model, [(state, 0, len(prompt))])["a"]]
    for tok in extra:
        state.token_ids.append(tok)
        n = len(state.token_ids)
        ours.append(_forward(model, [(state, n - 1, 1)])["a"])
    _record("prefill+decode", (torch.cat(ours) - ref).abs().max().item())


@needs_model
def test_chunked_prefill_matches_hf(model, hf_model, prompts):
    prompt = prompts[1]
    ref = _hf_logits(hf_model, prompt)
    _fresh_cache(model)
    state = _state("a", prompt, 3)
    cuts = [0, 7, 23, len(prompt)]  # three chunks, crossing block boundaries
    ours = [_forward(model, [(state, a, b - a)])["a"] for a, b in zip(cuts, cuts[1:])]
    _record("chunked prefill", (torch.cat(ours) - ref).abs().max().item())


@needs_model
def test_two_requests_batched_match_hf(model, hf_model, prompts):
    p0, p1 = prompts[0], prompts[2]
    extra0, extra1 = [330, 1345, 28], [2683, 17]
    ref0 = _hf_logits(hf_model, p0 + extra0)
    ref1 = _hf_logits(hf_model, p1 + extra1)
    _fresh_cache(model)
    s0, s1 = _state("r0", p0, 1), _state("r1", p1, 20)
    # Step 1: r0 whole prompt, r1 first chunk. Step 2: r0 decodes while r1 finishes its prompt.
    got = _forward(model, [(s0, 0, len(p0)), (s1, 0, 10)])
    ours0, ours1 = [got["r0"]], [got["r1"]]
    s0.token_ids.append(extra0[0])
    got = _forward(model, [(s0, len(p0), 1), (s1, 10, len(p1) - 10)])
    ours0.append(got["r0"])
    ours1.append(got["r1"])
    # Then both decode together (batched single-token path, different context lengths).
    for i in range(2):
        s0.token_ids.append(extra0[i + 1])
        s1.token_ids.append(extra1[i])
        got = _forward(model, [(s0, len(s0.token_ids) - 1, 1), (s1, len(s1.token_ids) - 1, 1)])
        ours0.append(got["r0"])
        ours1.append(got["r1"])
    diff = max(
        (torch.cat(ours0) - ref0).abs().max().item(),
        (torch.cat(ours1) - ref1[: len(p1) + 2]).abs().max().item(),
    )
    _record("two batched", diff)


# --- the runner, driven by a minimal controller ---------------------------------------------


@pytest.fixture(scope="module")
def runner():
    cfg = ExecutorConfig(
        model=MODEL_DIR,
        device="cpu",
        block_size=BLOCK,
        seed=7,
        max_num_batched_tokens=256,
        max_num_seqs=8,
    )
    r = GPUModelRunner(cfg, load_model_geometry(MODEL_DIR))
    r.load_model()
    r.initialize_kv_cache(64)
    assert r.capture_model() == 0
    return r


@needs_model
def test_cpu_runner_takes_the_one_call_decoder_stack(runner):
    """With the C++ kernels built, the served path (and so the HF comparisons below) runs the
    decoder stack in one kernel call."""
    from executor_gpu.cpu.kernels import load_kernels

    if load_kernels() is None:
        pytest.skip("no C++ toolchain for the kernels")
    assert runner.model.stack_forward is not None


@needs_model
def test_greedy_batch_matches_hf_generate(runner, hf_model, prompts):
    runner.reset()
    ctl = MiniController(runner, budget=12)
    reqs = [ctl.add(f"g{i}", p) for i, p in enumerate(prompts)]
    ctl.run()
    assert len(runner.input_batch) == 0  # finished ids dropped every state
    for req, prompt in zip(reqs, prompts):
        with torch.inference_mode():
            ref = hf_model.generate(
                torch.tensor([prompt]),
                max_new_tokens=20,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert req.output == ref[0, len(prompt) :].tolist()


@needs_model
def test_logprobs_and_prompt_logprobs_match_hf(runner, hf_model, prompts):
    runner.reset()
    ctl = MiniController(runner, budget=10)
    prompt = prompts[2]
    req = ctl.add("lp", prompt, SamplingParams(logprobs=3, prompt_logprobs=2), max_tokens=2)
    ctl.run()
    ref = torch.log_softmax(_hf_logits(hf_model, prompt + req.output[:1]), dim=-1)
    assert len(req.prompt_logprobs) == len(prompt) - 1
    for i, lp in enumerate(req.prompt_logprobs):
        assert lp.token_id == prompt[i + 1]
        assert abs(lp.logprob - ref[i, prompt[i + 1]].item()) < 1e-3
        assert lp.rank == int((ref[i] > ref[i, prompt[i + 1]]).sum()) + 1
        assert lp.top_token_ids == ref[i].topk(2).indices.tolist()
    first = req.logprobs[0]
    assert first.token_id == req.output[0] and first.rank == 1  # greedy
    assert first.top_token_ids == ref[len(prompt) - 1].topk(3).indices.tolist()
    assert abs(first.logprob - ref[len(prompt) - 1].max().item()) < 1e-3


@needs_model
def test_seeded_sampling_survives_recompute(runner, prompts):
    assert_seeded_sampling_survives_recompute(runner, prompts[1])


@needs_model
def test_request_errors_stay_isolated(runner, prompts, monkeypatch):
    runner.reset()
    ok = NewRequestData("ok", prompts[0][:8], [], SamplingParams(), [1], 0, 8)
    short = NewRequestData("short", prompts[0][:20], [], SamplingParams(), [2], 0, 20)
    bad_tok = NewRequestData("badtok", [1, 10**6], [], SamplingParams(), [3], 0, 2)
    out = runner.execute_model(StepInput(0, new_requests=[ok, short, bad_tok]))
    by_id = {o.request_id: o for o in out.outputs}
    assert by_id["ok"].sampled_token_id is not None and not by_id["ok"].error
    assert "blocks" in by_id["short"].error and by_id["short"].sampled_token_id is None
    assert by_id["badtok"].error
    # Non-finite logits for one row fail that request only, and drop its state.
    real = runner.model.compute_logits

    def poisoned(hidden):
        logits = real(hidden)
        logits[0] = float("nan")
        return logits

    monkeypatch.setattr(runner.model, "compute_logits", poisoned)
    a = NewRequestData("a", prompts[0][:4], [], SamplingParams(), [4], 0, 4)
    b = NewRequestData("b", prompts[1][:4], [], SamplingParams(), [5], 0, 4)
    out = runner.execute_model(StepInput(1, new_requests=[a, b]))
    errors = [o for o in out.outputs if o.error]
    assert len(errors) == 1 and errors[0].sampled_token_id is None
    assert len([o for o in out.outputs if o.sampled_token_id is not None]) == 1
    monkeypatch.undo()
    gone = errors[0].request_id
    out = runner.execute_model(StepInput(2, cached_requests=[CachedRequestData(gone, [], 4, 1)]))
    assert "unknown" in out.outputs[0].error


@needs_model
def test_a_non_finite_hidden_state_fails_its_request_alone(runner, prompts, monkeypatch):
    """In a decode step (one token per row) and in a step mixing a prompt with a decode."""
    for case, lens in (("decode", (1, 1)), ("mixed", (1, 3))):
        runner.reset()
        starts = [
            NewRequestData(f"{case}{i}", prompts[i][:4], [], SamplingParams(), [1 + i], 0, 4)
            for i in range(2)
        ]
        runner.execute_model(StepInput(0, new_requests=starts))
        real = runner.model.forward

        def poisoned(*args, real=real, row=lens[0], **kwargs):
            hidden = real(*args, **kwargs)
            hidden[row] = float("nan")  # the second request's (first) token
            return hidden

        monkeypatch.setattr(runner.model, "forward", poisoned)
        if case == "decode":
            step = StepInput(
                1, cached_requests=[CachedRequestData(r.request_id, [], 4, 1) for r in starts]
            )
        else:  # the first request decodes, a new one prefills 3 tokens
            third = NewRequestData("mixed2", prompts[2][:3], [], SamplingParams(), [3], 0, 3)
            step = StepInput(
                1,
                new_requests=[third],
                cached_requests=[CachedRequestData(starts[0].request_id, [], 4, 1)],
            )
        out = runner.execute_model(step)
        monkeypatch.undo()
        failed = {o.request_id for o in out.outputs if o.error}
        assert len(failed) == 1, (case, out.outputs)
        assert len([o for o in out.outputs if o.sampled_token_id is not None]) == 1


@needs_model
def test_dummy_and_profile_runs_keep_no_state(runner):
    runner.reset()
    runner.dummy_run(40, 4)
    runner.dummy_run(4, 4)
    assert runner.profile_run() == 0  # CPU: no allocator statistics
    assert len(runner.input_batch) == 0


@needs_model
def test_worker_lifecycle_on_cpu(prompts):
    cfg = ExecutorConfig(
        model=MODEL_DIR,
        device="auto",
        block_size=BLOCK,
        num_threads=0,
        kv_cache_bytes=64 * 2**20,
        max_num_batched_tokens=64,
        max_num_seqs=4,
    )
    worker = GPUWorker(cfg)
    worker.init_device()
    if torch.cuda.is_available():
        pytest.skip("CPU lifecycle test; CUDA present")
    assert worker.device_kind == "cpu"
    worker.load_model()
    profile = worker.determine_available_memory()
    assert profile.available_kv_bytes == 64 * 2**20
    assert 500e6 < profile.weights_bytes < 600e6  # 135M float32 parameters (tied head once)
    spec = worker.get_kv_cache_spec()
    num_blocks = profile.available_kv_bytes // spec.bytes_per_block
    _, graphs = worker.initialize_cache(num_blocks)
    assert graphs == 0 and worker.check_health()
    assert worker.model_runner.kv_caches[0].shape == (2, num_blocks, BLOCK, 3, 64)
    step = StepInput(
        0,
        new_requests=[
            NewRequestData("w", prompts[0], [], SamplingParams(), [1, 2, 3], 0, len(prompts[0]))
        ],
    )
    out = worker.execute_model(step)
    assert out.outputs[0].sampled_token_id == 504  # "The" (greedy, as transformers answers)
    assert out.device_seconds > 0
    info = worker.describe()
    assert info.device_kind == "cpu" and info.model.num_layers == 30


# --- tiny random checkpoints: other architectures and checkpoint layouts -------------------

_TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


def _tiny_config(kind):
    if kind == "llama3-rope-sharded":
        return transformers.LlamaConfig(
            **_TINY,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        )
    if kind == "qwen2-qkv-bias":
        return transformers.Qwen2Config(**_TINY)
    if kind == "mistral-head-dim":
        return transformers.MistralConfig(**{**_TINY, "head_dim": 32})
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["llama3-rope-sharded", "qwen2-qkv-bias", "mistral-head-dim"])
def test_tiny_checkpoints_match_hf(tmp_path, kind):
    cfg = _tiny_config(kind)
    hf = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():  # larger than the default init, biases included
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(tmp_path, max_shard_size="100KB" if "sharded" in kind else "1GB")
    if "sharded" in kind:
        assert (tmp_path / "model.safetensors.index.json").exists()
    ours = build_model(str(tmp_path), torch.float32, "cpu")
    geometry = load_model_geometry(str(tmp_path))
    assert geometry.architecture == type(hf).__name__
    assert geometry.head_dim == ours.args.head_dim
    ids = torch.randint(0, 256, (150,), generator=gen).tolist()  # past 64: llama3 scaling
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    _fresh_cache(ours)
    state = RequestState("t", ids[:148], 148, list(range(1, 12)), SamplingParams())
    got = [_forward(ours, [(state, 0, 100)])["t"], _forward(ours, [(state, 100, 48)])["t"]]
    for tok in ids[148:]:
        state.token_ids.append(tok)
        got.append(_forward(ours, [(state, len(state.token_ids) - 1, 1)])["t"])
    diff = (torch.cat(got) - ref).abs().max().item()
    scale = ref.abs().max().item()
    print(f"{kind}: max |logit diff| = {diff:.3g} (logits up to {scale:.3g})")
    assert diff < 1e-4 * max(1.0, scale)
