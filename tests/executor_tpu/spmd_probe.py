"""Run the TPU worker on XLA:CPU, sharded over ``--tp`` virtual devices (or not, with 1), and
write what the SPMD tests check as JSON: every weight's and KV tensor's sharding, the layout,
the warm-up's and later compilations, the last-token logits of a prompt, greedy outputs under
chunked prefill with batched decodes, and a prefix hit, and greedy outputs within allowed-token
masks (structured output: sampling runs on the logits gathered over the vocabulary shards).

SPMD is process-wide in torch_xla (``use_spmd`` before any tensor), so each size runs in its
own process: ``python -m tests.executor_tpu.spmd_probe --tp 2 IN.json OUT.json``. IN holds
``{"prompts": [[token ids], ...]}``. ``--reference-kernel`` takes the ragged kernel's path with
torch_xla's non-kernel reference standing in for the kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("PJRT_DEVICE", "CPU")

import torch  # noqa: E402

from common.host.settings import ExecutorConfig  # noqa: E402
from common.torch.input_batch import RequestState, ScheduledRow  # noqa: E402
from common.wire.step_types import SamplingParams  # noqa: E402
from executor_tpu.options import TPUOptions  # noqa: E402
from executor_tpu.static_batch import build_static_step, pick_bucket  # noqa: E402
from executor_tpu.worker import TPUWorker  # noqa: E402
from tests.executor_tpu.masks import MASKED, MaskingRunner, pack  # noqa: E402
from tests.support.mini_controller import BLOCK, MODEL_DIR, MiniController  # noqa: E402


def _static_kernel(q, kv_pages, kv_lens, page_indices, cu_q_lens, num_seqs, **kw):
    """What the ragged paged attention kernel computes, with static shapes (torch_xla's own
    reference reads lengths on the host, which a per-device region cannot): every query token
    attends causally to its row's pages (and window); padding tokens get zeros."""
    assert kw.pop("use_kernel") is True
    t, num_heads, head_dim = q.shape
    rows, width = page_indices.shape
    page = kv_pages.shape[1]
    kv_heads = kv_pages.shape[2] // 2
    token = torch.arange(t, device=q.device)
    row = (cu_q_lens[1 : rows + 1][None, :] <= token[:, None]).sum(dim=1)
    real = row < num_seqs[0]
    row = row.clamp(max=rows - 1)
    pos = kv_lens[row] - (cu_q_lens[1:][row] - token)  # each token's position in its row
    ctx = kv_pages[page_indices[row].reshape(-1)].view(t, width * page, 2 * kv_heads, head_dim)
    keys, values = ctx[:, :, 0::2].float(), ctx[:, :, 1::2].float()
    span = torch.arange(width * page, device=q.device)[None, :]
    visible = (span <= pos[:, None]) & real[:, None]
    if kw.get("sliding_window"):
        visible &= span > pos[:, None] - kw["sliding_window"]
    qg = q.float().view(t, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("tkgd,tlkd->tkgl", qg, keys) * kw["sm_scale"]
    if kw.get("soft_cap"):
        scores = torch.tanh(scores / kw["soft_cap"]) * kw["soft_cap"]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.nan_to_num(scores.softmax(dim=-1))
    out = torch.einsum("tkgl,tlkd->tkgd", weights, values)
    return out.reshape(t, num_heads, head_dim).to(q.dtype)


def _reference_kernel() -> None:
    """Stand the static reference in for the ragged paged attention kernel (which runs only on
    a TPU): the kernel path's layout, padding and per-device region are what is checked."""
    import torch_xla.experimental.custom_kernel as custom_kernel

    custom_kernel.ragged_paged_attention = _static_kernel


def _worker(tp: int, attention: str) -> TPUWorker:
    cfg = ExecutorConfig(
        model=MODEL_DIR,
        block_size=BLOCK,
        seed=7,
        max_model_len=256,
        kv_cache_bytes=64 * 2**20,
        tensor_parallel_size=tp,
    )
    options = TPUOptions(token_buckets=[16, 64], compile_cache_dir="", attention=attention)
    worker = TPUWorker(cfg, options)
    worker.init_device()
    worker.load_model()
    worker.configure(64, 8, 256)
    worker.warmup = worker.initialize_cache(64)
    return worker


def _shardings(worker: TPUWorker) -> dict[str, str]:
    from executor_tpu.spmd import sharding_of

    runner = worker.model_runner
    found = {name: sharding_of(p) for name, p in runner.model.named_parameters()}
    found.update({f"kv_cache.{i}": sharding_of(c) for i, c in enumerate(runner.kv_caches)})
    return found


def _last_logits(worker: TPUWorker, prompt: list[int]) -> list[float]:
    runner = worker.model_runner
    state = RequestState("l", list(prompt), len(prompt), list(range(1, 5)), SamplingParams())
    rows = [ScheduledRow(state, 0, len(prompt), True, 0)]
    plan = runner.plan
    step = build_static_step(
        rows,
        pick_bucket(len(prompt), plan.token_buckets),
        pick_bucket(1, plan.request_buckets),
        runner.max_blocks,
        BLOCK,
    )
    with torch.no_grad():
        _, _, logits, _ = runner.forward_step(step.arrays())
    return logits.cpu()[0].tolist()


def _greedy(worker: TPUWorker, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Three prompts batched in 12-token steps (chunked prefill, batched decodes), then the
    first again over the blocks of its finished run's prompt (a prefix hit)."""
    worker.model_runner.reset()
    ctl = MiniController(worker.model_runner, budget=12)
    reqs = [ctl.add(f"g{i}", p, max_tokens=12) for i, p in enumerate(prompts)]
    ctl.run()
    blocks = list(reqs[0].blocks)  # freed, but still holding the first prompt's keys / values
    cached = (len(prompts[0]) - 1) // BLOCK * BLOCK  # whole blocks of the prompt
    ctl.free = [b for b in ctl.free if b not in blocks[: cached // BLOCK]]
    hit = ctl.add(
        "hit", prompts[0], max_tokens=12, blocks=blocks[: cached // BLOCK], computed=cached
    )
    ctl.run()
    return {**{r.rid: r.output for r in reqs}, "hit": hit.output}


def _masked(worker: TPUWorker, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Constrained greedy rows next to an unconstrained one, in 12-token steps."""
    runner = worker.model_runner
    runner.reset()
    vocab = runner.geometry.vocab_size
    masks = {rid: pack(tokens, vocab) for rid, tokens in MASKED.items()}
    ctl = MiniController(MaskingRunner(runner, masks), budget=12)
    reqs = [ctl.add(f"m{i}", p, max_tokens=6) for i, p in enumerate(prompts)]
    ctl.run()
    return {r.rid: r.output for r in reqs}


def main() -> None:
    """Probe one size; write the JSON report."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--reference-kernel", action="store_true", help="ragged path, reference")
    parser.add_argument("inp")
    parser.add_argument("out")
    args = parser.parse_args()
    with open(args.inp) as f:
        prompts = json.load(f)["prompts"]
    started = time.perf_counter()
    if args.reference_kernel:
        _reference_kernel()
    worker = _worker(args.tp, "ragged" if args.reference_kernel else "auto")
    runner = worker.model_runner
    report = {
        "device_name": worker.device_name,
        "attention": worker.model_runner.attention_backend,
        "capabilities_tp": worker.describe().capabilities.tensor_parallel_size,
        "kv_shape": list(runner.kv_caches[0].shape),
        "bytes_per_block": runner.get_kv_cache_spec().bytes_per_block,
        "chip_weights_bytes": runner.chip_weights_bytes,
        "weights_bytes": runner.weights_bytes,
        "warmup_compiled": worker.warmup[1],
        "warmup_seconds": worker.warmup[0],
        "shardings": _shardings(worker),
        "greedy": _greedy(worker, prompts),
        "masked": _masked(worker, prompts),
        "compiled_after_warmup": runner.compile_watch.after_warmup,
        # Last: fetching the vocabulary-split logits (never done while serving) compiles a
        # program that gathers them.
        "logits": _last_logits(worker, prompts[0]),
        "seconds": time.perf_counter() - started,
    }
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
