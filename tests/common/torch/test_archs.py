"""Every served architecture against transformers on a tiny random checkpoint (CPU, float32):
logits through chunked prefill and decodes (prompts past the sliding window), then greedy
tokens through the GPU executor's runner with chunked prefill, recompute after preemption and
a prefix-cache hit. The TPU executor's runner runs the same checks in
tests/executor_tpu/test_archs.py."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import InputBatch, RequestState, ScheduledRow  # noqa: E402
from common.torch.models import build_model  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402
from tests.support.cpu_runner import runner_device  # noqa: E402
from tests.support.mini_controller import BLOCK  # noqa: E402
from tests.support.tiny_models import (  # noqa: E402
    KINDS,
    WINDOW,
    random_prompts,
    run_greedy_checks,
    save_tiny_checkpoint,
)

RESULTS: dict[str, str] = {}  # kind -> measured agreement (printed with -s)


@pytest.fixture(scope="module", params=list(KINDS))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_checkpoint(request.param, str(path))
    return request.param, str(path), hf


def _forward(model, rows):
    ib = InputBatch(BLOCK, model.args.vocab_size, 1024, "cpu")
    rows = [ScheduledRow(s, c, n, c + n == len(s.token_ids), 0) for s, c, n in rows]
    batch = ib.build(rows)
    with torch.inference_mode():
        return model.compute_logits(model(batch.input_ids, batch.positions, batch.attn))


def test_logits_match_transformers(tiny):
    kind, path, hf = tiny
    geometry = load_model_geometry(path)
    assert geometry.architecture == type(hf).__name__
    ours = build_model(path, torch.float32, "cpu")
    if KINDS[kind]:
        assert WINDOW in ours.args.windows
    caches = [
        torch.zeros(2, 16, BLOCK, geometry.num_kv_heads, geometry.head_dim)
        for _ in range(geometry.num_layers)
    ]
    ours.bind_kv_cache(caches)
    (ids,) = random_prompts(0, [150])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0]
    state = RequestState("t", ids[:148], 148, list(range(1, 11)), SamplingParams())
    # Chunks of 100 and 48 tokens (the second starts far past the window), then two decodes.
    got = [_forward(ours, [(state, 0, 100)]), _forward(ours, [(state, 100, 48)])]
    for tok in ids[148:]:
        state.token_ids.append(tok)
        got.append(_forward(ours, [(state, len(state.token_ids) - 1, 1)]))
    diff = (torch.cat(got) - ref).abs().max().item()
    scale = ref.abs().max().item()
    RESULTS[f"{kind} logits"] = f"max |diff| {diff:.2g} (logits up to {scale:.2g})"
    print(f"{kind}: max |logit diff| = {diff:.3g} (logits up to {scale:.3g})")
    assert diff < 1e-4 * max(1.0, scale)


def test_gpu_runner_greedy_matches_transformers(tiny):
    kind, path, hf = tiny
    cfg = ExecutorConfig(
        model=path, device=runner_device(), block_size=BLOCK, seed=7, max_num_batched_tokens=64
    )
    runner = GPUModelRunner(cfg, load_model_geometry(path))
    runner.load_model()
    runner.initialize_kv_cache(64)
    # Only plain Llama layers over whole-context attention may take the one-call stack.
    assert runner.model.stack_forward is None
    checks = run_greedy_checks(runner, hf)
    RESULTS[f"{kind} gpu runner"] = f"{checks.tokens} greedy tokens, {len(checks.mismatches)} off"
    print(f"{kind}: {checks.tokens} greedy tokens compared, mismatches: {checks.mismatches}")
    assert not checks.mismatches


def test_controller_frees_blocks_out_of_the_window(tmp_path):
    """The controller's own scheduler over the GPU runner, for a model whose every layer is
    windowed: a 150-token prompt in 16-token steps holds a few blocks, not all ten, and gives
    transformers' tokens; the same prompt again hits the released (still cached) blocks and
    gives the same tokens."""
    from controller.core.request import Request
    from controller.core.scheduler import Scheduler, SchedulerConfig
    from tests.support.tiny_models import hf_greedy

    hf = save_tiny_checkpoint("mistral-window", str(tmp_path))
    geometry = load_model_geometry(str(tmp_path))
    assert geometry.layer_windows == [WINDOW] * 3 and geometry.uniform_window == WINDOW
    cfg = ExecutorConfig(model=str(tmp_path), device="cpu", block_size=BLOCK)
    runner = GPUModelRunner(cfg, geometry)
    runner.load_model()
    runner.initialize_kv_cache(32)
    sched = Scheduler(
        SchedulerConfig(
            max_num_batched_tokens=16,
            max_num_seqs=4,
            block_size=BLOCK,
            num_blocks=32,
            max_model_len=512,
            sliding_window=geometry.uniform_window,
        )
    )
    (prompt,) = random_prompts(3, [150])

    def run(rid: str) -> tuple[list[int], int]:
        sched.add_request(Request(rid, list(prompt), SamplingParams(), max_tokens=6))
        out, peak = [], 0
        while sched.has_unfinished_requests():
            step = sched.schedule()
            peak = max(peak, sched.kv.num_used_blocks)
            for update in sched.update_from_output(step, runner.execute_model(step)):
                assert not update.error
                out += update.new_token_ids
        return out, peak

    first, peak = run("a")
    assert first == hf_greedy(hf, prompt, 6)
    assert peak <= -(-(WINDOW + 16) // BLOCK) + 1  # the window, one step's tokens, one spare
    second, _ = run("b")
    assert sched.kv.prefix_cache_hits >= 9 * BLOCK
    assert second == first


def test_moe_grouped_and_dense_forms_agree(tmp_path):
    """The eager form (tokens grouped by expert) and the static-shape one (every expert, a
    dense routing matrix; XLA and CUDA graph capture) compute the same block."""
    from common.torch.models.moe import SparseMoeBlock

    save_tiny_checkpoint("qwen3-moe", str(tmp_path))
    model = build_model(str(tmp_path), torch.float32, "cpu")
    block = model.model.layers[0].mlp
    assert isinstance(block, SparseMoeBlock) and block.w_gate_up.shape == (8, 64, 64)
    assert not isinstance(model.model.layers[1].mlp, SparseMoeBlock)  # mlp_only_layers
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(2))
    with torch.inference_mode():
        experts, weights = block.route(x)
        assert torch.allclose(weights.sum(-1), torch.ones(37))  # norm_topk_prob
        grouped = block._grouped(x, experts, weights)
        dense = block._dense(x, experts, weights)
    torch.testing.assert_close(grouped, dense, rtol=1e-5, atol=1e-5)


def test_gemma_reads_older_config_keys():
    """Checkpoints saved before transformers 5 (the Hub's Gemma 2 and Gemma 3 files): no
    layer_types, the local RoPE base as rope_local_base_freq, RoPE scaling as rope_scaling."""
    from common.torch.models.gemma import GemmaArgs

    base = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        query_pre_attn_scalar=256,
        sliding_window=512,
    )
    gemma3 = GemmaArgs.from_config(
        dict(
            base,
            model_type="gemma3_text",
            num_hidden_layers=7,
            sliding_window_pattern=6,
            rope_theta=1e6,
            rope_local_base_freq=1e4,
            rope_scaling={"rope_type": "linear", "factor": 8.0},
            final_logit_softcapping=None,
            attn_logit_softcapping=None,
        )
    )
    assert gemma3.windows == [512] * 5 + [0, 512] and gemma3.qk_norm
    assert gemma3.local_layers == [True] * 5 + [False, True]
    assert (gemma3.rope_theta, gemma3.rope_scaling["factor"]) == (1e6, 8.0)
    assert (gemma3.local_rope_theta, gemma3.local_rope_scaling) == (1e4, None)
    assert gemma3.query_scale == 256**-0.5 and gemma3.final_softcap == 0.0
    gemma2 = GemmaArgs.from_config(
        dict(
            base,
            model_type="gemma2",
            num_hidden_layers=4,
            rope_theta=1e4,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
        )
    )
    assert gemma2.windows == [512, 0, 512, 0] and not gemma2.qk_norm
    assert gemma2.local_rope_theta == gemma2.rope_theta == 1e4
    assert (gemma2.attn_softcap, gemma2.final_softcap) == (50.0, 30.0)
    assert gemma2.tie_word_embeddings
