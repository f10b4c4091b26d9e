"""GPUModelRunner: model, paged KV cache, persistent batch and sampling on CUDA (or the CPU).

The step skeleton, model loading and KV allocation come from ``common.torch.runner``; this
module runs a built step eagerly: one forward pass over every scheduled token, logits only for
the rows that need them (sampling positions, prompt-logprob positions), one batched sampling
pass (``common.torch.sampling``), one device-to-host copy of the results.

On CUDA it uses executor_gpu's Triton kernels: decode and prefill attention over the paged
cache ("triton_paged": a step's decodes in one launch, its prefill chunks in another) and the
fused per-layer ops (``triton_layer_ops``), and replays pure decode
steps from CUDA graphs (``cuda/graphs.py``; not with enforce_eager). On the CPU (float32 or
bfloat16, the KV cache in the same dtype) it uses
the C++ kernels where they build: paged attention of decodes and prefill chunks ("cpu_paged")
and the fused per-layer ops (``cpu/layer_ops.py``). TANDEM_CUDA_KERNELS=0 / TANDEM_CPU_KERNELS=0
keep the torch implementations.
"""

from __future__ import annotations

import logging
import os

import torch

from common.host.settings import ExecutorConfig
from common.torch.attention import get_attention_backend
from common.torch.input_batch import RequestState, ScheduledRow, StepBatch
from common.torch.parallel import SINGLE, TensorParallel
from common.torch.runner import (
    RowResults,
    TorchModelRunner,
    prompt_logprob_count,
    split_prompt_logprobs,
)
from common.torch.sampling import (
    LogprobsTensors,
    Sampler,
    build_sampling_metadata,
    compute_prompt_logprobs,
)
from common.wire.config import ModelGeometry
from common.wire.step_types import StepInput
from executor_gpu.cpu import kernels as cpu_kernels
from executor_gpu.cuda.graphs import DecodeGraphs
from executor_gpu.overlap import PendingRows, fill_placeholders, leave_placeholders
from executor_gpu.ranks.group import RankGroup
from executor_gpu.ranks.leader_model import LeaderModel
from executor_gpu.warm_up import PROMPT_LOGPROB_SLICE, WarmUp

log = logging.getLogger(__name__)


def resolve_device(spec: str) -> torch.device:
    """ "auto" -> the current CUDA device when there is one, else the CPU; a CUDA device always
    comes back with its index."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class GPUModelRunner(WarmUp, TorchModelRunner):
    """Runs steps of a served model (any family) on a CUDA device or the CPU.

    Under tensor parallelism, rank 0's runner holds the ``RankGroup`` of followers (``ranks``)
    and drives its model through ``LeaderModel``; each follower runs this class too, with its
    ``tp`` rank and no group (executor_gpu.follower).
    """

    def __init__(
        self,
        config: ExecutorConfig,
        geometry: ModelGeometry,
        tp: TensorParallel = SINGLE,
        device: torch.device | None = None,
        ranks: RankGroup | None = None,
    ):
        device = device or resolve_device(config.device)
        super().__init__(config, geometry, device, tp=tp)
        self.ranks = ranks  # rank 0 of several: the followers it drives
        self.sampler = Sampler(config.seed, self.device)  # noise for unseeded rows
        self.fused_ops = None  # the device's fused layer ops, where it has them
        self.stack_forward_of = None  # builds the model's one-call decoder stack, where it has one
        self.graphs: DecodeGraphs | None = None  # decode replay, set up by capture_model
        self.scan_logits = None  # float32 logits -> (argmax, finite) per row in one pass (CPU)
        # The sampled tokens of the step in flight (launched, not finished), if it samples.
        self._in_flight_samples: torch.Tensor | None = None
        self._resets = 0  # resets and cache reallocations so far (a pending step's scrub)
        if self.device.type == "cuda" and self._cuda_kernels_apply():
            try:
                from executor_gpu.cuda import triton_attention, triton_layer_ops
            except ImportError as exc:  # no Triton: torch's operators, eager
                log.warning("Triton kernels unavailable (%s): running torch operators", exc)
            else:
                triton_attention.register()
                self.attention_backend = triton_attention.BACKEND_NAME
                self.fused_ops = triton_layer_ops.CUDA_LAYER_OPS
        # On the CPU in float32 or bf16: the C++ kernels for attention and the layer ops.
        if self.device.type == "cpu" and self._cpu_kernels_apply():
            from executor_gpu.cpu import attention as cpu_attention
            from executor_gpu.cpu import decoder_stack as cpu_decoder_stack
            from executor_gpu.cpu import layer_ops as cpu_layer_ops

            if cpu_attention.register():  # attention in place in the paged cache
                self.attention_backend = cpu_attention.BACKEND_NAME
                self.fused_ops = cpu_layer_ops.layer_ops()
                self.stack_forward_of = cpu_decoder_stack.stack_forward_of
                self.scan_logits = cpu_kernels.load_kernels().scan_logits

    def _cuda_kernels_apply(self) -> bool:
        """Whether the Triton kernels serve: they read a cache of the model's dtype; another
        cache dtype (fp8) runs torch's attention, which widens it on read, eagerly."""
        if os.environ.get("TANDEM_CUDA_KERNELS", "1") == "0":
            return False
        p = self.precision
        if p.kv_cache_dtype == p.dtype:
            return True
        log.warning(
            "a %s KV cache under %s weights: torch's attention (widening the cache on read) and "
            "no decode graphs; the Triton kernels read a cache of the model's dtype",
            p.kv_cache_dtype,
            p.dtype,
        )
        return False

    def _cpu_kernels_apply(self) -> bool:
        """Whether the CPU's C++ kernels serve this precision (float32 or bf16, the cache in
        the model's dtype); any other precision runs the torch implementations, said once in
        the log."""
        if not cpu_kernels.enabled():
            return False
        p = self.precision
        if p.dtype in ("float32", "bfloat16") and p.kv_cache_dtype == p.dtype:
            return True
        log.warning(
            "dtype %s with a %s KV cache on the CPU: the torch implementations serve (the C++ "
            "kernels take float32 or bfloat16 weights with a cache of the same dtype)",
            p.dtype,
            p.kv_cache_dtype,
        )
        return False

    def load_model(self) -> None:
        """Load the model, then switch it to the device's fused layer ops where they exist;
        rank 0 of several has the followers load their shards meanwhile."""
        if self.ranks is not None:
            self.ranks.send("load", reply=True)
        self._load_local()
        if self.ranks is not None:
            self.weights_bytes += sum(self.ranks.gather())  # the executor's, all shards
            self.model = LeaderModel(self.model, self.ranks)

    def _load_local(self) -> None:
        """Build and load this rank's model (the whole model for one rank), then its ops."""
        super().load_model()
        if self.fused_ops is not None:
            self.model.set_layer_ops(self.fused_ops)
        if self.fused_ops is not None and self.stack_forward_of is not None:
            self.model.set_stack_forward(
                self.stack_forward_of(  # the layers in one kernel call
                    cpu_kernels.load_kernels(),
                    self.model,
                    get_attention_backend(self.attention_backend),
                )
            )

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate the cache (the followers theirs first)."""
        if self.ranks is not None:
            self.ranks.call("kv", num_blocks)
        super().initialize_kv_cache(num_blocks)

    def after_kv_cache_allocated(self) -> None:
        """Graphs captured over the old cache tensors are dropped (capture_model recaptures)."""
        self.graphs = None
        self._resets += 1

    def reset(self) -> None:
        """Forget every request and restart unseeded sampling from the configured seed."""
        super().reset()
        self.sampler.reseed(self.config.seed)
        self._resets += 1
        self._in_flight_samples = None

    # --- steps ----------------------------------------------------------------------------

    @property
    def overlaps_steps(self) -> bool:
        """Whether the next step is launched before the one in flight is finished (executor_gpu.
        overlap): on CUDA with one rank unless --overlap-steps off; on the CPU only when forced
        on (a CPU step runs whole at its launch: overlapping would only delay its result)."""
        mode = self.config.overlap_steps
        if mode == "off" or self.ranks is not None or self.tp.size > 1:
            return False
        return mode == "on" or self.device.type == "cuda"

    def run_rows(self, rows: list[ScheduledRow]) -> RowResults:
        """Build the step's tensors, then forward, logits, sampling and prompt logprobs."""
        return self.finish_rows(self.launch_rows(rows))

    def launch_rows(self, rows: list[ScheduledRow]) -> PendingRows:
        """Queue the step's device work (inputs, forward, logits, sampling, the results' copy
        to the host) without waiting for the device, except for prompt logprobs; leave a
        placeholder for each sampled token (executor_gpu.overlap)."""
        batch = self.input_batch.build(rows)
        if batch.has_placeholders:  # decodes of tokens the step in flight samples
            batch.input_ids = fill_placeholders(batch.input_ids, self._in_flight_samples)
        sample_states = [rows[i].state for i in batch.sample_rows]
        # Sampling tensors go to the device before the forward pass is queued, so that the
        # sampler's launches follow it at once.
        meta = self._sampling_metadata(sample_states) if sample_states else None
        replayed = None
        if (
            self.graphs is not None
            and len(batch.sample_rows) == len(rows)
            and not batch.prompt_lp_rows
        ):
            replayed = self.graphs.run(batch.input_ids, batch.positions, batch.attn)
        if replayed is not None:  # a pure decode step: hidden states and logits by replay
            hidden, decode_logits = replayed
        else:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn)
            decode_logits = None
        # Per request: did any of its tokens produce a non-finite hidden state? (A sum is
        # finite exactly when every term is.)
        token_sums = hidden.sum(dim=-1, dtype=torch.float32)
        if batch.attn.num_decodes == len(rows):  # one token per row, in the rows' order
            row_sums = token_sums
        else:
            row_sums = torch.zeros(len(rows), dtype=torch.float32, device=self.device)
            row_sums.index_add_(0, batch.token_rows, token_sums)
        sampled, logprobs = None, None
        if meta is not None:
            logits = (
                decode_logits
                if decode_logits is not None
                else self.model.compute_logits(hidden[batch.logits_indices])
            )
            argmax = None  # float32 [S, vocab] by compute_logits' contract, as the scan reads
            if self.scan_logits is not None:
                argmax, logits_ok = self.scan_logits(logits)
            else:
                logits_ok = logits.sum(dim=-1).isfinite()
            # Zero non-finite rows to keep the batch sane (on the CPU, only when there are any:
            # the check is cheap there, rewriting [S, vocab] is not).
            all_ok = self.device.type == "cpu" and bool(logits_ok.all())
            if not all_ok:
                logits = logits.masked_fill(~logits_ok[:, None], 0.0)
            result = self.sampler(logits, meta, argmax if all_ok else None)
            sampled, logprobs = result.sampled_token_ids, result.logprobs
            if not all_ok:  # mark the rows whose logits were not finite as failed
                nan_if_bad = torch.where(logits_ok, 0.0, float("nan"))
                row_sums = row_sums.index_add(0, batch.sample_index, nan_if_bad)
        pending = PendingRows.start(
            batch,
            sampled,
            row_sums.isfinite(),
            logprobs,
            meta.num_logprobs if meta is not None else [],
            self._resets,
        )
        if batch.prompt_lp_rows:  # waits for the device: such a step is not overlapped
            pending.prompt_logprobs = self._prompt_logprobs(hidden, batch)
        self._in_flight_samples = pending.samples = sampled
        leave_placeholders(rows, batch.sample_rows)
        return pending

    def rows_done(self, pending: PendingRows) -> bool:
        """Whether the rows' results have reached the host."""
        return pending.done()

    def finish_rows(self, pending: PendingRows) -> RowResults:
        """The rows' host results (waiting for their copy); the cache slots that rows which
        failed (or whose request was let go meanwhile) wrote are zeroed."""
        results = pending.results()
        if pending.samples is self._in_flight_samples:  # no launch since: nothing in flight
            self._in_flight_samples = None  # (the next step fills in no placeholder)
        if pending.resets == self._resets:  # a reset since: the cache is another session's
            rows = pending.batch.rows
            for i in sorted(results.failed | {i for i, r in enumerate(rows) if r.state.dropped}):
                self._scrub(pending.batch, i)
        return results

    def _scrub(self, batch: StepBatch, row: int) -> None:
        """Zero the KV slots a failed request wrote in this step, so that no non-finite value
        stays in the cache (attention relies on masked slots being finite)."""
        if not self.kv_caches:
            return
        qsl = batch.attn.query_start_loc_host
        slots = batch.attn.slot_mapping[qsl[row] : qsl[row + 1]]
        if self.ranks is not None:
            self.model.scrub_slots(slots)
        self.zero_slots(slots)

    def zero_slots(self, slots: torch.Tensor) -> None:
        """Zero these token slots in every layer's cache (keys and values)."""
        for cache in self.kv_caches:
            cache.view(2, -1, *cache.shape[3:])[:, slots] = 0

    def step_needs_results(self, step: StepInput) -> bool:
        """Never: a penalty row's history may end in a token still being sampled, and its
        placeholder is filled in on the device like an input's (``_sampling_metadata``)."""
        return False

    def _sampling_metadata(self, states: list[RequestState]):
        """Sampling tensors of the sampling rows (token histories only for penalty rows, with
        the placeholders of tokens in flight filled in on the device; the structured-output
        masks of this step's constrained rows)."""
        params = [s.sampling for s in states]
        pen = [p.has_penalties for p in params]
        meta = build_sampling_metadata(
            params,
            positions=[len(s.token_ids) for s in states],
            prompt_ids=[s.prompt_token_ids if pen[i] else () for i, s in enumerate(states)],
            output_ids=[s.output_token_ids if pen[i] else () for i, s in enumerate(states)],
            vocab_size=self.geometry.vocab_size,
            device=self.device,
            max_logprobs=self.config.max_logprobs,
            num_outputs=[s.num_output_tokens for s in states],
            masks=[s.allowed_token_mask for s in states],
        )
        in_flight = self._in_flight_samples  # a step in flight: histories may end in its token
        if in_flight is not None and meta.output_tokens is not None:
            meta.output_tokens = fill_placeholders(meta.output_tokens, in_flight)
        if in_flight is not None and meta.seen_tokens is not None:
            meta.seen_tokens = fill_placeholders(meta.seen_tokens, in_flight)
        return meta

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> dict[int, list]:
        """Prompt logprobs of the positions computed in this step, per row index."""
        rows = [batch.rows[i] for i in batch.prompt_lp_rows]
        ks = [prompt_logprob_count(r, self.config.max_logprobs) for r in rows]
        pieces = []
        total = batch.prompt_lp_indices.shape[0]
        for start in range(0, total, PROMPT_LOGPROB_SLICE):
            sl = slice(start, start + PROMPT_LOGPROB_SLICE)
            logits = self.model.compute_logits(hidden[batch.prompt_lp_indices[sl]])
            pieces.append(compute_prompt_logprobs(logits, batch.prompt_lp_targets[sl], max(ks)))
        merged = LogprobsTensors(
            *(
                torch.cat([getattr(p, f) for p in pieces])
                for f in ("token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")
            )
        )
        per_position = [k for r, k in zip(rows, ks) for _ in range(r.num_prompt_logprobs)]
        return split_prompt_logprobs(
            batch.rows, batch.prompt_lp_rows, merged.to_token_logprobs(per_position)
        )
