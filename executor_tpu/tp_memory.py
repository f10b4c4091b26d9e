"""The KV budget of a tensor-parallel TPU executor, per chip.

Every chip holds its share of the weights (``TPUModelRunner.chip_weights_bytes``), its heads of
every KV block (``1 / size`` of a block, whole heads) and the activations of its shard of a
step. The budget is set by the smallest chip: ``limit x gpu_memory_utilization - weights -
peak activations``, and the executor's KV budget is that times the chips (the controller sees
one pool of blocks of ``bytes_per_block``, split evenly over the chips).

torch_xla 2.9 reports no memory statistics for the chips behind the SPMD virtual device, so the
limits are read before SPMD starts (``executor_tpu.spmd.chip_limits``) and the activation peak
is modelled rather than measured: with the gather attention, its context at the largest token
bucket (every token gathers ``max_model_len`` keys and values of its chip's heads, plus float32
copies and scores; the kernel reads the pages in place); the largest request bucket's float32
logits and their sorted copies; and the per-token hidden / MLP activations.
"""

from __future__ import annotations

import logging
from typing import Any

from common.wire.config import MemoryProfile
from executor_tpu.spmd import SpmdMesh

log = logging.getLogger(__name__)

#: Live float32 copies of the logits while sampling (logits, adjusted, sorted, indices).
_LOGIT_COPIES = 4
#: Live float32 copies of the per-token hidden and MLP activations.
_ACTIVATION_COPIES = 4


def modelled_peak_bytes(runner: Any, size: int) -> int:
    """Bytes of activations one chip holds at the runner's largest step (see module doc)."""
    plan, layout, args = runner.plan, runner.layout, runner.model.args
    tokens, rows = plan.token_buckets[-1], plan.request_buckets[-1]
    context = runner.max_blocks * runner.config.block_size
    kv_heads = layout.padded_kv_heads // size
    heads = kv_heads * (args.num_heads // args.num_kv_heads)
    gathered = scores = 0
    if runner.attention_backend == "xla_gather":  # the kernel reads the pages in place
        gathered = (
            tokens * context * 2 * kv_heads * layout.head_dim * (runner.precision.kv_bytes + 4)
        )
        scores = 2 * tokens * heads * context * 4
    logits = _LOGIT_COPIES * rows * args.vocab_size * 4
    per_token = args.hidden_size + 2 * args.intermediate_size // size
    hidden = _ACTIVATION_COPIES * tokens * per_token * 4
    return gathered + scores + logits + hidden


def sharded_memory_profile(runner: Any, mesh: SpmdMesh, utilization: float) -> MemoryProfile:
    """The KV budget of all chips, set by the smallest chip's room (see module doc)."""
    peak = modelled_peak_bytes(runner, mesh.size)
    limit = min(mesh.chip_limits)
    per_chip = int(limit * utilization) - runner.chip_weights_bytes - peak
    log.info(
        "KV budget %.2f GiB per chip x %d chips (HBM %.2f GiB, weights %.2f GiB, modelled "
        "peak activations %.2f GiB per chip)",
        per_chip / 2**30,
        mesh.size,
        limit / 2**30,
        runner.chip_weights_bytes / 2**30,
        peak / 2**30,
    )
    return MemoryProfile(
        available_kv_bytes=max(0, per_chip) * mesh.size,
        weights_bytes=runner.weights_bytes,
        peak_activation_bytes=peak,
    )
