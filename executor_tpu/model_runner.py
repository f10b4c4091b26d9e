"""TPUModelRunner: the shared torch runner on an XLA device, with static shapes.

A step (after the shared diff handling) runs as three precompiled XLA programs:

1. forward — the step padded to a (token bucket, request bucket) pair (see static_batch):
   embeddings, layers with static paged attention and KV writes, final norm, logits of each
   row's last token, and per-row finiteness;
2. sampling — one of the variants of executor_tpu.sampler for the request bucket (a masked one
   when a row carries an allowed-token mask: see executor_tpu.token_mask);
3. prompt logprobs — only on steps that ask for them, for the token bucket.

Inputs are built on the host and moved in one batch; the packed results come back in one copy
(two when prompt logprobs were asked for). The KV tensors are donated to the forward program,
which updates them in place instead of copying the cache every step. ``capture_model`` runs
every (bucket pair, variant) once so that serving compiles nothing; ``CompileWatch`` checks
that after each step.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch
import torch_xla
import torch_xla.core.xla_model as xm
from torch_xla.utils.buffer_donor_context import alias_with_buffer_donor_config

from common.host.settings import ExecutorConfig
from common.torch.input_batch import ScheduledRow
from common.torch.runner import RowResults, TorchModelRunner, prompt_logprob_count
from common.torch.sampling import seed_key
from common.wire.config import Capabilities, KVCacheSpec, ModelGeometry
from executor_tpu.attention import StaticAttentionMetadata
from executor_tpu.attention_choice import choose_attention, choose_layout, is_tpu
from executor_tpu.compile_watch import CompileWatch, persistent_cache_counters
from executor_tpu.options import TPUOptions
from executor_tpu.sampler import (
    VARIANTS,
    SampleVariant,
    SamplingInputs,
    build_sampling_inputs,
    sample,
    token_logprobs,
    unpack_logprobs,
)
from executor_tpu.spmd import SpmdMesh
from executor_tpu.static_batch import (
    BucketPlan,
    StaticStep,
    build_static_step,
    pick_bucket,
    plan_buckets,
)
from executor_tpu.tp_model import KV_SPEC, shard_model
from executor_tpu.warmup import FabricatedRun, warmup_runs

log = logging.getLogger(__name__)

#: Mixed into the executor seed for the noise keys of unseeded rows.
_UNSEEDED_SALT = 0x5DEECE66D


class TPUModelRunner(TorchModelRunner):
    """Runs steps of a served model (any family) on a TPU (or XLA:CPU) with precompiled shapes."""

    def __init__(
        self,
        config: ExecutorConfig,
        geometry: ModelGeometry,
        options: TPUOptions,
        device: torch.device,
        mesh: SpmdMesh | None = None,
    ):
        super().__init__(config, geometry, device, batch_device="cpu")
        self.options = options  # buckets, attention, layout, cache
        self.mesh = mesh  # the SPMD mesh the model is sharded over; None = one device
        self.chip_weights_bytes = 0  # weights one chip holds (set by load_model)
        attention = choose_attention(options.attention, device)
        self.attention_backend = f"xla_{attention}"
        self.layout = choose_layout(
            attention, options.kv_layout, geometry, self.precision.kv_bytes, mesh
        )
        self.compile_watch = CompileWatch()  # compilations during / after warm-up
        self.max_blocks = self._table_width()  # block-table width (fixed per warm-up)
        self._unseeded_draws = 0  # noise keys handed to unseeded rows since reset()

    # --- shapes ---------------------------------------------------------------------------

    @property
    def plan(self) -> BucketPlan:
        """The buckets for the controller's current step limits."""
        return plan_buckets(
            self.config.max_num_batched_tokens,
            self.config.max_num_seqs,
            self.options.token_buckets,
            self.options.request_buckets,
        )

    def _table_width(self) -> int:
        return -(-self.geometry.max_model_len // self.config.block_size)

    def get_capabilities(self) -> Capabilities:
        """Chunked prefill as configured, plus the buckets (the scheduler sizes steps to
        fit the largest)."""
        plan = self.plan
        return Capabilities(
            chunked_prefill=self.config.chunked_prefill,
            max_tokens_per_step=plan.max_tokens,
            token_buckets=list(plan.token_buckets),
            request_buckets=list(plan.request_buckets),
            max_num_seqs=plan.max_seqs,
            max_logprobs=self.config.max_logprobs,
            tensor_parallel_size=self.config.tensor_parallel_size,
        )

    def get_kv_cache_spec(self) -> KVCacheSpec:
        """Block size and bytes of the (possibly padded) layout."""
        spec = super().get_kv_cache_spec()
        shape = self.layout.shape(1, self.config.block_size)
        spec.bytes_per_block = (
            int(np.prod(shape)) * self.precision.kv_bytes * self.geometry.num_layers
        )
        return spec

    # --- hooks of the shared runner -------------------------------------------------------

    @classmethod
    def device_kind_of(cls, device: torch.device) -> str:
        """A TPU is "tpu" (--dtype auto: the checkpoint's dtype); XLA:CPU is the CPU."""
        return "tpu" if is_tpu(device) else "cpu"

    def load_device(self) -> str:
        """Weights are read on the host, then moved (one transfer per tensor)."""
        return "cpu"

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        if self.mesh is None:
            model = model.to(self.device)
            # Moving to XLA makes a tied parameter two device tensors (the move cannot swap the
            # shared tensor's storage in place): share it again, or the device holds both.
            model.tie_weights()
            self.chip_weights_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        else:
            per_device = self.layout.padded_kv_heads // self.mesh.size
            self.chip_weights_bytes = shard_model(model, self.mesh, self.device, per_device)
        torch_xla.sync()
        return model

    def kv_cache_shape(self, num_blocks: int) -> tuple[int, ...]:
        return self.layout.shape(num_blocks, self.config.block_size)

    def after_kv_cache_allocated(self) -> None:
        if self.mesh is not None:
            # Annotated while still lazy: each device materializes only its heads.
            for cache in self.kv_caches:
                self.mesh.shard(cache, KV_SPEC)
        torch_xla.sync()
        self.max_blocks = self._table_width()

    def reset(self) -> None:
        """Forget every request and restart the unseeded noise keys."""
        super().reset()
        self._unseeded_draws = 0

    # --- steps ----------------------------------------------------------------------------

    def run_rows(self, rows: list[ScheduledRow]) -> RowResults:
        """Pad the rows to their buckets, run the precompiled programs, unpack the results."""
        plan = self.plan
        num_tokens = sum(r.num_scheduled for r in rows)
        step = build_static_step(
            rows,
            pick_bucket(num_tokens, plan.token_buckets),
            pick_bucket(len(rows), plan.request_buckets),
            self.max_blocks,
            self.config.block_size,
        )
        sampling = self._sampling_inputs(rows, step.request_bucket)
        packed, prompt = self._execute(step, sampling, any(r.num_prompt_logprobs for r in rows))
        self.compile_watch.check(
            f"a step of {num_tokens} tokens x {len(rows)} requests "
            f"(buckets {step.token_bucket} x {step.request_bucket}, "
            f"sampling {sampling.variant})"
        )
        return self._unpack(step, sampling, packed, prompt)

    def _sampling_inputs(
        self, rows: list[ScheduledRow], request_bucket: int, variant: SampleVariant | None = None
    ) -> SamplingInputs:
        keys = []
        for _ in rows:
            keys.append(seed_key(self.config.seed ^ _UNSEEDED_SALT, self._unseeded_draws))
            self._unseeded_draws += 1
        return build_sampling_inputs(
            [r.state.sampling for r in rows],
            [r.state.token_ids for r in rows],
            [r.state.num_prompt_tokens for r in rows],
            request_bucket,
            self.geometry.vocab_size,
            self.geometry.max_model_len,
            self.config.max_logprobs,
            keys,
            variant,
            [r.state.allowed_token_mask if r.samples else None for r in rows],
        )

    def _execute(
        self, step: StaticStep, sampling: SamplingInputs, with_prompt_logprobs: bool
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Move the inputs, run forward / sampling / prompt logprobs, fetch the results."""
        d, hidden, logits, row_ok = self.forward_step({**step.arrays(), **sampling.arrays()})
        packed = self._to_host(
            sample(logits, row_ok, d, sampling.variant, self.config.max_logprobs)
        )
        torch_xla.sync()
        prompt = None
        if with_prompt_logprobs:
            prompt = token_logprobs(
                self.model.compute_logits(hidden), d["prompt_lp_targets"], self.config.max_logprobs
            )
            prompt = self._to_host(prompt)
            torch_xla.sync()
        return packed.cpu().numpy(), None if prompt is None else prompt.cpu().numpy()

    def _to_host(self, result: torch.Tensor) -> torch.Tensor:
        """A result the host will fetch: under SPMD, computed whole on every device (else its
        copy to the host would run a program of its own to gather the shards)."""
        return result if self.mesh is None else self.mesh.replicate(result)

    def forward_step(self, arrays: dict[str, np.ndarray]):
        """Move ``arrays`` (a StaticStep's, plus anything later programs read) in one batch and
        run the forward program; returns (device inputs by name, hidden [T, H], last-token
        logits [R, V], row finiteness [R]), all materialized on the device."""
        moved = xm.send_cpu_data_to_device(
            [torch.from_numpy(a) for a in arrays.values()], self.device
        )
        d = dict(zip(arrays, moved))
        # The KV tensors are updated in place: donate their buffers to the forward program's
        # outputs, or every step would copy the whole cache.
        for cache in self.kv_caches:
            torch_xla._XLAC._set_buffer_donation(cache, True)
        hidden, logits, row_ok = self._forward(d)
        with alias_with_buffer_donor_config():
            torch_xla.sync()
        return d, hidden, logits, row_ok

    def _forward(self, d: dict[str, torch.Tensor]):
        """Hidden states [T, H], last-token logits [R, V] and row finiteness [R]."""
        meta = StaticAttentionMetadata(
            slot_mapping=d["slot_mapping"],
            positions=d["positions"],
            token_rows=d["token_rows"],
            block_tables=d["block_tables"],
            seq_lens=d["seq_lens"],
            query_start_loc=d["query_start_loc"],
            num_seqs=d["num_seqs"],
            block_size=self.config.block_size,
            layout=self.layout,
            mesh=self.mesh,
        )
        hidden = self.model(d["input_ids"], d["positions"], meta)
        logits = self.model.compute_logits(hidden.index_select(0, d["logits_indices"]))
        rows = logits.shape[0]
        bad = (~hidden.float().sum(dim=-1).isfinite()).float()
        per_row = torch.zeros(rows + 1, device=hidden.device).index_add(0, d["token_rows"], bad)
        row_ok = (per_row[:rows] == 0) & logits.sum(dim=-1).isfinite()
        return hidden, logits, row_ok

    def _unpack(
        self,
        step: StaticStep,
        sampling: SamplingInputs,
        packed: np.ndarray,
        prompt: np.ndarray | None,
    ) -> RowResults:
        rows = step.rows
        results = RowResults.empty(len(rows))
        qsl = step.query_start_loc
        for i, row in enumerate(rows):
            if packed[i, 1] < 0.5:
                results.failed.add(i)
                continue
            if row.samples:
                token = int(packed[i, 0])
                results.sampled[i] = token
                k = sampling.num_logprobs[i]
                if k is not None:
                    results.logprobs[i] = unpack_logprobs(packed[i, 2:], token, k)
            if prompt is not None and row.num_prompt_logprobs:
                k = prompt_logprob_count(row, self.config.max_logprobs)
                start, c = int(qsl[i]), row.num_computed
                results.prompt_logprobs[i] = [
                    unpack_logprobs(prompt[start + j], row.state.token_ids[c + 1 + j], k)
                    for j in range(row.num_prompt_logprobs)
                ]
        return results

    # --- warm-up and profiling ------------------------------------------------------------

    def _run_fabricated(self, run: FabricatedRun) -> None:
        """One fabricated row (null blocks only) padded to the run's shapes."""
        cap = self.max_blocks * self.config.block_size - 1
        tokens = max(1, min(run.num_tokens, run.token_bucket, cap))
        rows = self.dummy_rows(tokens, 1, 0, run.sampling_params())
        step = build_static_step(
            rows, run.token_bucket, run.request_bucket, self.max_blocks, self.config.block_size
        )
        sampling = self._sampling_inputs(rows, run.request_bucket, run.variant)
        self._execute(step, sampling, run.prompt_logprobs)

    def dummy_run(self, num_tokens: int, num_reqs: int) -> None:
        """A greedy step of fabricated tokens padded like a real one of that size."""
        plan = self.plan
        t, r = (
            pick_bucket(num_tokens, plan.token_buckets),
            pick_bucket(num_reqs, plan.request_buckets),
        )
        with torch.no_grad():
            self._run_fabricated(FabricatedRun(num_tokens, t, r, VARIANTS[0], False))

    def capture_model(self) -> int:
        """Compile every forward shape, sampling variant and prompt-logprob shape (see
        executor_tpu.warmup); returns the XLA programs compiled."""
        plan = self.plan
        runs = warmup_runs(plan)
        log.info(
            "warm-up: %d runs: forward for %d shapes (tokens %s x requests %s) with "
            "prompt logprobs per token bucket, then %d sampling variants per request "
            "bucket",
            len(runs),
            len(plan.pairs()),
            plan.token_buckets,
            plan.request_buckets,
            len(VARIANTS),
        )
        self.compile_watch.start_warmup()
        started = time.perf_counter()
        with torch.no_grad():
            for done, run in enumerate(runs, 1):
                t0 = time.perf_counter()
                self._run_fabricated(run)
                elapsed = time.perf_counter() - t0
                log.info("warm-up %d/%d: %s (%.1fs)", done, len(runs), run.label, elapsed)
        seconds = time.perf_counter() - started
        compiled = self.compile_watch.end_warmup(seconds)
        self._unseeded_draws = 0
        log.info(
            "warm-up done in %.1fs: %d XLA programs compiled (%.1fs in the compiler); "
            "persistent cache %s",
            seconds,
            compiled,
            self.compile_watch.warmup_compile_seconds,
            persistent_cache_counters(),
        )
        return compiled

    def profile_run(self) -> int:
        """The largest shape with a throwaway cache of one sequence's blocks; returns the peak
        device bytes beyond the weights (TPU memory statistics)."""
        plan = self.plan
        saved, saved_blocks = self.kv_caches, self.num_blocks
        self.initialize_kv_cache(self.max_blocks + 1)
        try:
            largest = plan.token_buckets[-1]
            run = FabricatedRun(
                largest, largest, plan.request_buckets[-1], SampleVariant("sort", True), True
            )
            with torch.no_grad():
                self._run_fabricated(run)
            info = xm.get_memory_info(self.device)
            peak = int(info.get("peak_bytes_used", info.get("bytes_used", 0)))
        finally:
            cache_bytes = sum(c.numel() * c.element_size() for c in self.kv_caches)
            self.kv_caches, self.num_blocks = saved, saved_blocks
            self.model.bind_kv_cache(saved or None)
            self._unseeded_draws = 0
        return max(0, peak - self.weights_bytes - cache_bytes)
