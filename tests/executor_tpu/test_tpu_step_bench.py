"""benchmarks/tpu_step.py on a tiny checkpoint: it runs at tp 1 and 2 and reads the partitioned
forward's collectives from XLA's dump, which are exactly the Megatron pattern: one all-reduce
per row-parallel layer (o_proj, down_proj), one for the vocabulary-split embedding lookup and
one for the row finiteness check over the vocabulary-split logits; nothing else."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.support.tiny_models import save_tiny_checkpoint

pytest.importorskip("torch_xla")

HLO = """
  %all-reduce.1 = f32[16,64]{1,0} all-reduce(%dot), channel_id=1, to_apply=%add
  %ag = (bf16[8,2]{1,0}, s32[4]{0}) all-gather-start(%x, %y), dimensions={1}
  %not = f32[3] add(%a, %b)
"""


def test_collectives_parsed_from_hlo_text():
    from benchmarks.tpu_step import collectives

    assert collectives(HLO) == {"all-reduce": [1, 16 * 64 * 4], "all-gather": [1, 32 + 16]}


def test_benchmark_reports_the_forward_collectives(tmp_path):
    save_tiny_checkpoint("qwen3", str(tmp_path / "tiny"))
    out = tmp_path / "tpu_step.json"
    cmd = [sys.executable, "benchmarks/tpu_step.py", "--model", str(tmp_path / "tiny")]
    cmd += ["--tensor-parallel-size", "1", "2", "--steps", "2", "--json", str(out)]
    subprocess.run(cmd, check=True, timeout=600)
    one, two = json.loads(out.read_text())
    assert one["forward_collectives"] == {} and one["compiled_after_warmup"] == 0
    layers = 2
    assert list(two["forward_collectives"]) == ["all-reduce"]
    assert two["forward_collectives"]["all-reduce"][0] == 2 * layers + 2
    assert two["compiled_after_warmup"] == 0
    assert two["weights_bytes_per_device"] < 0.6 * one["weights_bytes_per_device"]
