"""The decoder stack in one kernel call (executor_gpu/cpu/decoder_stack.cpp) against the same
model run layer by layer: identical hidden states and KV caches, and the cases it declines."""

from __future__ import annotations

import pytest
import torch

from common.torch.attention import get_attention_backend
from common.torch.models.llama import LlamaForCausalLM
from executor_gpu.cpu import attention as cpu_attention
from executor_gpu.cpu.decoder_stack import stack_forward_of
from executor_gpu.cpu.kernels import load_kernels
from executor_gpu.cpu.layer_ops import layer_ops
from tests.executor_gpu.paged_cases import step_meta

pytestmark = pytest.mark.skipif(load_kernels() is None, reason="no C++ toolchain for the kernels")

BLOCK, BLOCKS = 16, 40


def tiny_model(
    hidden: int = 128, heads: int = 4, kv_heads: int = 2, qwen2: bool = False, seed: int = 0
) -> LlamaForCausalLM:
    """A random 3-layer model on the CPU kernels (Qwen2: biases on q/k/v)."""
    config = {
        "vocab_size": 320,
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "num_hidden_layers": 3,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 256,
        "model_type": "qwen2" if qwen2 else "llama",
    }
    model = LlamaForCausalLM(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    assert cpu_attention.register()
    model.set_attention_backend(cpu_attention.BACKEND_NAME)
    model.set_layer_ops(layer_ops())
    return model


def bind_random_cache(model: LlamaForCausalLM, seed: int) -> list[torch.Tensor]:
    a = model.args
    g = torch.Generator().manual_seed(seed)
    caches = [
        torch.randn(2, BLOCKS, BLOCK, a.num_kv_heads, a.head_dim, generator=g)
        for _ in range(a.num_layers)
    ]
    model.bind_kv_cache(caches)
    return caches


def run(model, ids, positions, meta, caches, stacked: bool):
    """Hidden states of one step, the KV caches bound to copies of ``caches``."""
    copies = [c.clone() for c in caches]
    model.bind_kv_cache(copies)
    model.set_stack_forward(
        stack_forward_of(load_kernels(), model, get_attention_backend(cpu_attention.BACKEND_NAME))
        if stacked
        else None
    )
    with torch.inference_mode():
        return model(ids, positions, meta), copies


@pytest.mark.parametrize("qwen2", [False, True])
@pytest.mark.parametrize(
    "lens,new",
    [
        ([9, 30, 17], [1, 1, 1]),  # decodes
        ([9, 14, 40], [1, 1, 23]),  # decodes and a prefill chunk after cached tokens
        ([33], [33]),  # a prefill from scratch
    ],
)
def test_stack_matches_the_layers_exactly(qwen2, lens, new):
    model = tiny_model(qwen2=qwen2)
    caches = bind_random_cache(model, 1)
    meta = step_meta(lens, new, BLOCK, BLOCKS, seed=2)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 320, (sum(new),), generator=g)
    positions = torch.tensor([p for n, k in zip(lens, new) for p in range(n - k, n)])
    expected, expected_caches = run(model, ids, positions, meta, caches, stacked=False)
    got, got_caches = run(model, ids, positions, meta, caches, stacked=True)
    assert model.stack_forward(model.model.embed_tokens(ids), positions, meta) is not None
    assert torch.equal(got, expected)
    assert all(torch.equal(a, b) for a, b in zip(got_caches, expected_caches))
    assert not torch.equal(got_caches[0], caches[0])  # the step's keys were stored


def test_stack_declines_where_its_kernels_do_not_all_apply():
    model = tiny_model()
    meta = step_meta([5], [1], BLOCK, BLOCKS, seed=0)
    x, positions = torch.randn(1, 128), torch.tensor([4])
    fn = stack_forward_of(load_kernels(), model, get_attention_backend(cpu_attention.BACKEND_NAME))
    with torch.inference_mode():
        assert fn(x, positions, meta) is None  # no KV cache bound (memory profiling)
        bind_random_cache(model, 0)
        assert fn(x, positions, meta) is not None
        model.set_attention_backend("torch")
        assert fn(x, positions, meta) is None  # another attention backend
        model.set_attention_backend(cpu_attention.BACKEND_NAME)
        assert fn(x, positions, meta) is not None
        model.bind_kv_cache(None)
        assert fn(x, positions, meta) is None  # the cache unbound again

    unpacked = tiny_model(hidden=96, heads=3, kv_heads=1)  # 96 columns: no whole panels
    bind_random_cache(unpacked, 0)
    fn = stack_forward_of(
        load_kernels(), unpacked, get_attention_backend(cpu_attention.BACKEND_NAME)
    )
    with torch.inference_mode():
        assert fn(torch.randn(1, 96), positions, meta) is None


def test_stack_rejects_a_bad_step_with_a_clear_error():
    model = tiny_model()
    caches = bind_random_cache(model, 0)
    meta = step_meta([5, 6], [1, 1], BLOCK, BLOCKS, seed=0)
    meta.query_start_loc = torch.tensor([0, 1, 3])  # spans 3 tokens, the step has 2
    with pytest.raises(RuntimeError, match="query_start_loc"):
        run(model, torch.tensor([1, 2]), torch.tensor([4, 5]), meta, caches, stacked=True)
