"""The tensor-parallel regrouping of executor_tpu.tp_model on plain CPU torch (no XLA, no mesh).

The fused projections are reordered so that each device's column tile holds whole heads /
units, with zero padding where counts do not divide. Run with a mesh stand-in that places no
annotation, the regrouped model must compute what the original computes: the same hidden
states (float32, the same reductions per head; only the fused matmuls' column order differs)
over a prefill and two decodes through the static gather attention and its KV cache. The
partition specs of the sharding plan are checked by name.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from common.torch.input_batch import RequestState, ScheduledRow  # noqa: E402
from common.torch.models import build_model  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_tpu.attention import StaticAttentionMetadata, plain_layout  # noqa: E402
from executor_tpu.head_groups import PAD, HeadGroups, UnitGroups, take  # noqa: E402
from executor_tpu.spmd import AXIS  # noqa: E402
from executor_tpu.static_batch import build_static_step  # noqa: E402
from executor_tpu.tp_model import (  # noqa: E402
    KV_SPEC,
    HeadGroupedAttention,
    param_spec,
    regroup_attention,
    regroup_mlp,
)
from tests.support.tiny_models import save_tiny_checkpoint  # noqa: E402

BLOCK = 16
WIDTH = 8  # block-table width: 128 tokens


class FakeMesh:
    """SpmdMesh's interface without XLA: no annotation."""

    def __init__(self, size: int):
        self.size = size

    def shard(self, tensor, spec):
        return tensor

    def heads(self, tensor):
        return tensor


def test_head_groups_whole_heads_per_device():
    g = HeadGroups(size=2, num_heads=9, num_kv_heads=3, head_dim=2)
    assert (g.padded_kv_heads, g.padded_heads, g.local_kv_heads, g.local_heads) == (4, 12, 2, 6)
    cols = g.qkv_columns()
    per_device = len(cols) // 2
    assert per_device == (6 + 2 + 2) * 2
    # device 0: q heads 0-5, k heads 0-1, v heads 0-1
    assert cols[:12] == list(range(12))
    assert cols[12:16] == [18, 19, 20, 21] and cols[16:20] == [24, 25, 26, 27]
    # device 1: q heads 6-8 then 3 zero heads, k head 2 then a zero head, v likewise
    dev1 = cols[per_device:]
    assert dev1[:6] == list(range(12, 18)) and dev1[6:12] == [PAD] * 6
    assert dev1[12:16] == [22, 23, PAD, PAD] and dev1[16:20] == [28, 29, PAD, PAD]
    assert g.o_rows() == list(range(18)) + [PAD] * 6
    u = UnitGroups(size=4, units=10)
    assert u.local_units == 3
    assert u.gate_up_columns()[:6] == [0, 1, 2, 10, 11, 12]
    assert u.gate_up_columns()[-6:] == [9, PAD, PAD, 19, PAD, PAD]
    assert u.down_rows() == list(range(10)) + [PAD, PAD]
    t = torch.arange(6.0).view(2, 3)
    assert take(t, [2, PAD, 0], 1).tolist() == [[2, 0, 0], [5, 0, 3]]


def test_partition_specs_by_name():
    assert param_spec("model.layers.3.self_attn.qkv_proj.weight", 2) == (None, AXIS)
    assert param_spec("model.layers.3.self_attn.qkv_proj.bias", 1) == (AXIS,)
    assert param_spec("model.layers.3.self_attn.o_proj.weight", 2) == (AXIS, None)
    assert param_spec("model.layers.3.self_attn.o_proj.bias", 1) == (None,)
    assert param_spec("model.layers.3.mlp.gate_up_proj.weight", 2) == (None, AXIS)
    assert param_spec("model.layers.3.mlp.down_proj.weight", 2) == (AXIS, None)
    assert param_spec("model.embed_tokens.weight", 2) == (AXIS, None)
    assert param_spec("lm_head.weight", 2) == (AXIS, None)
    assert param_spec("model.layers.0.input_layernorm.weight", 1) == (None,)
    assert param_spec("model.layers.0.mlp.gate.weight", 2) == (None, None)  # MoE router
    assert param_spec("model.layers.0.mlp.w_gate_up", 3) == (None, None, AXIS)
    assert param_spec("model.layers.0.mlp.w_down", 3) == (None, AXIS, None)
    assert KV_SPEC == (None, None, AXIS, None)


def _save(kind: str, path: str) -> None:
    if kind != "odd-llama":
        save_tiny_checkpoint(kind, path)
        return
    # The default model's head shape (9 query / 3 KV heads) and units that no size divides.
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=72,
        intermediate_size=101,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=8,
        max_position_embeddings=256,
        attention_bias=True,
    )
    hf = transformers.AutoModelForCausalLM.from_config(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)


def _steps(prompt: list[int]):
    """A two-chunk prefill, then two decodes: (rows, token bucket) per step."""
    state = RequestState(
        "r", list(prompt), len(prompt), list(range(1, WIDTH + 1)), SamplingParams()
    )
    cut = len(prompt) // 2
    yield [ScheduledRow(state, 0, cut, False, 0)], 32
    yield [ScheduledRow(state, cut, len(prompt) - cut, True, 0)], 32
    for token in (7, 11):
        state.token_ids.append(token)
        yield [ScheduledRow(state, len(state.token_ids) - 1, 1, True, 0)], 16


def _run(model, kv_heads: int, prompt: list[int]) -> list[torch.Tensor]:
    layout = plain_layout(kv_heads, model.args.head_dim)
    caches = [torch.zeros(layout.shape(WIDTH + 1, BLOCK)) for _ in model.model.layers]
    model.bind_kv_cache(caches)
    hidden = []
    for rows, bucket in _steps(prompt):
        arrays = build_static_step(rows, bucket, 4, WIDTH, BLOCK).arrays()
        d = {k: torch.from_numpy(v) for k, v in arrays.items()}
        meta = StaticAttentionMetadata(
            **{k: d[k] for k in ("slot_mapping", "positions", "token_rows", "block_tables")},
            seq_lens=d["seq_lens"],
            query_start_loc=d["query_start_loc"],
            num_seqs=d["num_seqs"],
            block_size=BLOCK,
            layout=layout,
        )
        n = sum(r.num_scheduled for r in rows)
        with torch.no_grad():
            hidden.append(model(d["input_ids"], d["positions"], meta)[:n].clone())
    return hidden


@pytest.mark.parametrize("kind", ["odd-llama", "qwen3", "gemma2"])
@pytest.mark.parametrize("size", [2, 3, 4])
def test_regrouped_model_computes_the_same(kind, size, tmp_path):
    _save(kind, str(tmp_path))
    model = build_model(str(tmp_path), torch.float32, "cpu", 128)
    model.set_attention_backend("xla_gather")
    prompt = list(range(3, 40))
    want = _run(model, model.args.num_kv_heads, prompt)
    sharded = copy.deepcopy(model)
    mesh = FakeMesh(size)
    groups = None
    for layer in sharded.model.layers:
        groups = regroup_attention(layer.self_attn, mesh)
        assert isinstance(layer.self_attn, HeadGroupedAttention)
        regrouped = regroup_mlp(layer.mlp, size)
        assert regrouped, "a gated MLP is regrouped"
    assert groups.padded_kv_heads % size == 0
    got = _run(sharded, groups.padded_kv_heads, prompt)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
