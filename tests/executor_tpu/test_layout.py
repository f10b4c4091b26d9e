"""KV layouts and attention paths of the TPU executor on a tiny random checkpoint (XLA:CPU).

The ragged paged attention kernel needs a padded KV layout (more kv heads, head size 128) and
runs only on a TPU. Here the padded layout is checked with the gather path, and the kernel's
argument plumbing (page table, lengths, query starts, head padding) with torch_xla's
non-kernel reference of the same operation standing in for the kernel. Programs compile lazily
(no warm-up): this file is about numerics, not compilation counts.
"""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("PJRT_DEVICE", "CPU")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("torch_xla")

import torch_xla.experimental.custom_kernel as custom_kernel  # noqa: E402

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import RequestState, ScheduledRow  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_tpu.options import TPUOptions  # noqa: E402
from executor_tpu.static_batch import build_static_step, pick_bucket  # noqa: E402
from executor_tpu.worker import TPUWorker  # noqa: E402

BLOCK = 16
# 3 kv heads of size 16: the kernel layout pads them to 4 heads of 128.
_TINY = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    hf = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**_TINY)).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    hf.save_pretrained(path)
    return str(path), hf


def _worker(path, **options):
    cfg = ExecutorConfig(model=path, block_size=BLOCK, max_model_len=128)
    worker = TPUWorker(
        cfg,
        TPUOptions(compile_cache_dir="", token_buckets=[16, 64], request_buckets=[4], **options),
    )
    worker.init_device()
    worker.load_model()
    worker.configure(64, 4, 128)
    worker.model_runner.initialize_kv_cache(24)
    return worker


def _logits(worker, rows):
    runner = worker.model_runner
    step = build_static_step(
        rows,
        pick_bucket(sum(r.num_scheduled for r in rows), runner.plan.token_buckets),
        4,
        runner.max_blocks,
        BLOCK,
    )
    with torch.no_grad():
        _, _, logits, _ = runner.forward_step(step.arrays())
    return logits.cpu()[: len(rows)]


def _check_against_hf(worker, hf):
    gen = torch.Generator().manual_seed(1)
    ids0 = torch.randint(0, 256, (60,), generator=gen).tolist()
    ids1 = torch.randint(0, 256, (23,), generator=gen).tolist()
    with torch.inference_mode():
        ref0, ref1 = hf(torch.tensor([ids0])).logits[0], hf(torch.tensor([ids1])).logits[0]
    s0 = RequestState("a", ids0[:57], 57, [1, 2, 3, 4], SamplingParams())
    s1 = RequestState("b", ids1[:21], 21, [9, 10], SamplingParams())
    diffs = []
    # a: chunks 0-20 and 20-57 (crossing blocks); b joins the second step whole.
    got = _logits(worker, [ScheduledRow(s0, 0, 20, False, 0)])
    diffs.append((got[0] - ref0[19]).abs().max())
    got = _logits(worker, [ScheduledRow(s0, 20, 37, True, 0), ScheduledRow(s1, 0, 21, True, 0)])
    diffs += [(got[0] - ref0[56]).abs().max(), (got[1] - ref1[20]).abs().max()]
    for i in range(2):  # decodes of both, batched
        s0.token_ids.append(ids0[57 + i])
        s1.token_ids.append(ids1[21 + i])
        n0, n1 = len(s0.token_ids), len(s1.token_ids)
        got = _logits(
            worker, [ScheduledRow(s0, n0 - 1, 1, True, 0), ScheduledRow(s1, n1 - 1, 1, True, 0)]
        )
        diffs += [(got[0] - ref0[n0 - 1]).abs().max(), (got[1] - ref1[n1 - 1]).abs().max()]
    scale = max(ref0.abs().max().item(), 1.0)
    assert max(d.item() for d in diffs) < 1e-4 * scale, diffs


def test_plain_layout_gather(tiny):
    path, hf = tiny
    worker = _worker(path, attention="gather", kv_layout="plain")
    assert worker.model_runner.kv_caches[0].shape == (24, BLOCK, 6, 16)
    _check_against_hf(worker, hf)


def test_padded_layout_gather(tiny):
    path, hf = tiny
    worker = _worker(path, attention="gather", kv_layout="padded")
    assert worker.model_runner.kv_caches[0].shape == (24, BLOCK, 8, 128)
    spec = worker.get_kv_cache_spec()
    assert spec.bytes_per_block == BLOCK * 8 * 128 * 4 * 2  # the padding is accounted for
    _check_against_hf(worker, hf)


def test_ragged_kernel_arguments_with_the_reference(tiny, monkeypatch):
    """The kernel path's inputs, fed to torch_xla's non-kernel reference instead."""
    calls = []

    def reference(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw):
        assert kw.pop("use_kernel") is True
        calls.append(q.shape)
        out = custom_kernel._ragged_paged_attention_nonkernel(
            q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, None, None, **kw
        )
        pad = torch.zeros(q.shape[0] - out.shape[0], *out.shape[1:], device=out.device)
        return torch.cat([out, pad])  # the kernel's output has every (padded) token

    monkeypatch.setattr(custom_kernel, "ragged_paged_attention", reference)
    path, hf = tiny
    worker = _worker(path, attention="ragged")
    assert worker.model_runner.attention_backend == "xla_ragged"
    assert worker.model_runner.kv_caches[0].shape == (24, BLOCK, 8, 128)
    _check_against_hf(worker, hf)
    assert calls and calls[0][1:] == (8, 128)  # query heads padded with the kv heads
