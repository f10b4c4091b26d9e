"""bf16 on the CPU (the C++ kernels' bf16 path) against transformers on the default model:
greedy agreement with transformers in bf16, and the logit error against transformers in bf16
and in float32. The measured figures are printed (pytest -s) for the docs.

bf16 arithmetic differs by summation order between any two implementations (GEMM blocking,
attention), and a bf16 rounding that lands on the other side of a midpoint changes a hidden
value by one bf16 unit: greedy paths may part where two candidates' logits are within bf16
noise. So the test asserts that most prompts agree on their first tokens and that the logit
error stays within a small multiple of transformers' own bf16-vs-float32 error.
"""

from __future__ import annotations

import pytest

from tests.support.mini_controller import BLOCK, MODEL_DIR, MiniController, needs_model

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import InputBatch, RequestState, ScheduledRow  # noqa: E402
from common.wire.model_config import load_model_geometry  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_gpu.cpu.kernels import load_kernels  # noqa: E402
from executor_gpu.model_runner import GPUModelRunner  # noqa: E402

pytestmark = [
    needs_model,
    pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels"),
    pytest.mark.skipif(torch.cuda.is_available(), reason="CPU test; CUDA present"),
]

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU cache is in two sentences.",
    "Give me a short recipe for pancakes.",
    "Translate 'good morning' into Spanish and German.",
]
NEW_TOKENS = 32
PREFIX = 8  # tokens that must agree from the start on most prompts


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


def hf_model(dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=dtype).eval()


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """NEW_TOKENS greedy tokens, no stop at EOS (as the runner, which leaves stopping to the
    controller)."""
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        tokens = []
        for _ in range(NEW_TOKENS):
            tokens.append(int(out.logits[0, -1].float().argmax()))
            out = model(
                torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True
            )
    return tokens


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].float()


def runner_logits(runner: GPUModelRunner, ids: list[int]) -> torch.Tensor:
    """Float32 logits of every position of ``ids`` in one prefill through the runner's model
    (its kernels, its bound cache)."""
    batch_builder = InputBatch(BLOCK, runner.geometry.vocab_size, 8192, "cpu")
    blocks = list(range(1, 1 + -(-len(ids) // BLOCK)))
    state = RequestState("tf", list(ids), len(ids), blocks, SamplingParams())
    batch = batch_builder.build([ScheduledRow(state, 0, len(ids), True, 0)])
    with torch.inference_mode():
        hidden = runner.model(batch.input_ids, batch.positions, batch.attn)
        return runner.model.compute_logits(hidden)


def agreement(ours: list[int], ref: list[int]) -> tuple[int, float]:
    """(tokens identical before the first divergence, share identical position by position)."""
    prefix = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), len(ref))
    return prefix, sum(a == b for a, b in zip(ours, ref)) / len(ref)


def test_bf16_on_the_cpu_agrees_with_transformers(prompts):
    config = ExecutorConfig(model=MODEL_DIR, device="cpu", dtype="bfloat16", max_num_seqs=8)
    runner = GPUModelRunner(config, load_model_geometry(MODEL_DIR))
    assert runner.attention_backend == "cpu_paged"  # the bf16 fast path, not the fallback
    runner.load_model()
    runner.initialize_kv_cache(128)
    assert runner.kv_caches[0].dtype == torch.bfloat16
    # Every prompt at once, prefills chunked by the budget, then batched decodes.
    ctl = MiniController(runner, budget=48, num_blocks=128)
    ours = [ctl.add(f"p{i}", p, max_tokens=NEW_TOKENS) for i, p in enumerate(prompts)]
    ctl.run()

    bf16, f32 = hf_model(torch.bfloat16), hf_model(torch.float32)
    prefixes, shares, err_bf16, err_f32, hf_err = [], [], 0.0, 0.0, 0.0
    for prompt, req in zip(prompts, ours):
        ref = hf_greedy(bf16, prompt)
        prefix, share = agreement(req.output, ref)
        prefixes.append(prefix)
        shares.append(share)
        # Logits along transformers' bf16 path (teacher-forced), at the generated positions.
        ids = prompt + ref
        sl = slice(len(prompt) - 1, len(ids) - 1)
        got = runner_logits(runner, ids)[sl]
        ref_bf16, ref_f32 = hf_logits(bf16, ids)[sl], hf_logits(f32, ids)[sl]
        err_bf16 = max(err_bf16, (got - ref_bf16).abs().max().item())
        err_f32 = max(err_f32, (got - ref_f32).abs().max().item())
        hf_err = max(hf_err, (ref_bf16 - ref_f32).abs().max().item())
    print(
        f"\nbf16 CPU vs transformers bf16, {len(prompts)} prompts x {NEW_TOKENS} greedy tokens: "
        f"identical prefix {prefixes}, position-wise agreement "
        f"{sum(shares) / len(shares):.1%} (per prompt {[f'{s:.0%}' for s in shares]}); "
        f"max |logit error| vs transformers bf16 {err_bf16:.3f}, vs float32 {err_f32:.3f} "
        f"(transformers bf16 vs float32: {hf_err:.3f})"
    )
    assert sum(p >= PREFIX for p in prefixes) >= len(prompts) - 1, prefixes
    assert sum(shares) / len(shares) >= 0.6, shares
    # Within a small multiple of the error bf16 itself brings (transformers' own).
    assert err_bf16 <= 2 * hf_err and err_f32 <= 2 * hf_err, (err_bf16, err_f32, hf_err)
