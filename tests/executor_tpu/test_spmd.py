"""The TPU executor sharded over 2 virtual XLA:CPU devices (torch_xla SPMD) against the same
executor unsharded and transformers, on the default model.

torch_xla 2.9 runs SPMD on XLA:CPU (``CPU_NUM_DEVICES`` virtual devices, which the executor
asks for itself): the sharded programs are really partitioned and run, so these are end-to-end
checks of the sharded executor, not only of its annotations. SPMD is process-wide, so each
size runs in its own process (``tests/executor_tpu/spmd_probe.py``), warmed up with token
buckets 16/64 and request bucket 8.

The default model has 9 query / 3 KV heads: over 2 devices they are padded to 12 / 4 (whole
heads per device), so the KV tensors carry 8 interleaved heads instead of 6.

Logit tolerance: the partitioned programs sum the row-parallel matmuls in two halves and reduce
across devices, a different float32 order than one device's; ``LOGIT_TOL`` is the unsharded
tests' 1e-3 (test_model.py), far below what a wrong head, shard or cache slot moves (> 0.1).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from executor_tpu.sampler import VARIANTS
from tests.executor_tpu.masks import MASKED
from tests.support.mini_controller import MODEL_DIR, needs_model
from tests.support.tiny_models import hf_greedy

LOGIT_TOL = 1e-3
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
#: Sharding strings XLA reports: split over the devices along one dimension, or none.
COLUMNS, ROWS = "{devices=[1,2]0,1}", "{devices=[2,1]0,1}"
KV_HEADS = "{devices=[1,1,2,1]0,1}"

pytestmark = [needs_model, pytest.mark.slow]


def _probe(tp: int, inp: str, out: str, *flags: str) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", TANDEM_MODEL_DIR=MODEL_DIR)
    env.pop("CPU_NUM_DEVICES", None)
    cmd = [sys.executable, "-m", "tests.executor_tpu.spmd_probe", "--tp", str(tp), *flags]
    cmd += [inp, out]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1500)
    assert done.returncode == 0, done.stderr[-4000:]
    with open(out) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def prompts(hf):
    return [hf.chat_ids([{"role": "user", "content": p}]) for p in PROMPTS]


@pytest.fixture(scope="module")
def runs(prompts, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("spmd")
    inp = str(tmp / "in.json")
    with open(inp, "w") as f:
        json.dump({"prompts": prompts}, f)
    found = {tp: _probe(tp, inp, str(tmp / f"out{tp}.json")) for tp in (2, 1)}
    found["ragged"] = _probe(2, inp, str(tmp / "ragged.json"), "--reference-kernel")
    for tp, r in found.items():
        print(f"{tp}: warm-up {r['warmup_seconds']:.1f}s, whole probe {r['seconds']:.1f}s")
    return found


def test_weights_and_kv_cache_sharded(runs):
    sharded = runs[2]
    assert "sharded over 2" in sharded["device_name"]
    assert sharded["capabilities_tp"] == 2 and runs[1]["capabilities_tp"] == 1
    specs = sharded["shardings"]
    for name, spec in specs.items():
        module = name.split(".")[-2]
        if name.startswith("kv_cache."):
            want = KV_HEADS
        elif module in ("qkv_proj", "gate_up_proj"):
            want = COLUMNS
        elif module in ("o_proj", "down_proj", "embed_tokens", "lm_head") and "weight" in name:
            want = ROWS
        else:
            want = ""
        assert spec.replace("{replicated}", "") == want, (name, spec)
    assert sum(n.startswith("kv_cache.") for n in specs) == 30
    assert sum(s == COLUMNS for s in specs.values()) == 60  # qkv + gate_up of 30 layers
    assert all(not s for s in runs[1]["shardings"].values())  # unsharded: no annotation
    # 3 KV heads padded to 4 (2 per device): 8 interleaved k/v heads, 4/3 of the bytes.
    assert sharded["kv_shape"][2:] == [8, 64] and runs[1]["kv_shape"][2:] == [6, 64]
    assert sharded["bytes_per_block"] * 3 == runs[1]["bytes_per_block"] * 4
    assert sharded["chip_weights_bytes"] < 0.6 * sharded["weights_bytes"]


def test_nothing_compiled_after_warmup(runs):
    for r in (runs[1], runs[2]):
        assert r["compiled_after_warmup"] == 0
    # Forward and prompt logprobs per token bucket (2 each), every sampling variant.
    assert runs[2]["warmup_compiled"] == runs[1]["warmup_compiled"] == 2 + 2 + len(VARIANTS)


def test_kernel_path_per_device(runs):
    """The ragged kernel's path, sharded: each device runs the kernel on its own heads (a
    manual region), with a static reference standing in for the kernel (TPU only): each
    device's 2 KV heads already tile for it, head size padded to 128."""
    ragged = runs["ragged"]
    assert ragged["attention"] == "xla_ragged"
    assert ragged["kv_shape"][2:] == [8, 128]
    assert ragged["shardings"]["kv_cache.0"] == KV_HEADS
    assert ragged["compiled_after_warmup"] == 0
    assert ragged["warmup_compiled"] == runs[1]["warmup_compiled"]
    assert ragged["greedy"] == runs[1]["greedy"]
    diff = max(abs(x - y) for x, y in zip(ragged["logits"], runs[1]["logits"]))
    assert diff < LOGIT_TOL


def test_masked_greedy_identical_to_unsharded(runs):
    """Allowed-token masks apply to the logits gathered over the vocabulary shards."""
    assert runs[2]["masked"] == runs[1]["masked"]
    for rid, tokens in MASKED.items():
        assert set(runs[2]["masked"][rid]) <= set(tokens)
    assert runs[2]["masked"]["m1"] == runs[2]["greedy"]["g1"][:6]  # unconstrained: unchanged


def test_logits_match_unsharded(runs):
    a, b = runs[2]["logits"], runs[1]["logits"]
    diff = max(abs(x - y) for x, y in zip(a, b))
    print(f"max |logit diff| sharded vs unsharded: {diff:.3g}")
    assert diff < LOGIT_TOL


def test_greedy_identical_to_unsharded_and_transformers(runs, hf, prompts):
    """Chunked prefill in 12-token steps, batched decodes, then a prefix hit."""
    assert runs[2]["greedy"] == runs[1]["greedy"]
    for i, prompt in enumerate(prompts):
        assert runs[2]["greedy"][f"g{i}"] == hf_greedy(hf.model, prompt, 12)
    assert runs[2]["greedy"]["hit"] == runs[2]["greedy"]["g0"]
