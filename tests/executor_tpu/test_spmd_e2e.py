"""The sharded TPU executor through a real controller: ``python -m executor_tpu
--tensor-parallel-size 2`` on XLA:CPU (two virtual devices, torch_xla SPMD), driven by the
unchanged controller with the TPU end-to-end test's tight limits and workload (chunked prefill,
preemption, prefix-cache hits).

Greedy outputs must be token-identical to transformers', and the executor must compile nothing
after warm-up (its Prometheus metric): the same checks as the unsharded executor's
(tests/e2e/test_tpu_e2e.py), whose outputs are also token-identical to transformers'.
"""

from __future__ import annotations

import httpx
import pytest

from executor_tpu.sampler import VARIANTS
from tests.e2e.helpers import assert_no_blocks_in_use, metric_sum
from tests.e2e.test_tpu_e2e import TIGHT, _start_tpu, _workload

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def sharded_server(default_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tpu-tp2")
    s = _start_tpu(default_model_dir, str(tmp), TIGHT, ["--tensor-parallel-size", "2"])
    yield s
    s.stop()


def test_sharded_tpu_matches_transformers(sharded_server, hf):
    got = _workload(sharded_server)
    for seq in got:
        cut = seq.index(-1)
        prompt, out = seq[:cut], seq[cut + 1 :]
        assert out == hf.greedy(prompt, len(out)), "sharded TPU output differs from transformers"
    metrics = httpx.get(sharded_server.base_url + "/metrics").text
    assert metric_sum(metrics, "vllm:num_preemptions_total") > 0
    assert metric_sum(metrics, "vllm:prefix_cache_hits_total") > 0
    assert_no_blocks_in_use(sharded_server)
    assert {e["kind"] for e in sharded_server.executors_state()} == {"tpu"}


def test_sharded_tpu_compiled_nothing_after_warmup(sharded_server):
    text = httpx.get(sharded_server.metrics_url, timeout=10).text
    assert metric_sum(text, "tandem:xla_warmup_compilations") == 3 + 3 + len(VARIANTS)
    assert metric_sum(text, "tandem:xla_compilations_after_warmup") == 0
