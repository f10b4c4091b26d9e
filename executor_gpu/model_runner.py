"""GPUModelRunner: model, paged KV cache, persistent batch and sampling on CUDA (or the CPU).

One step = apply the controller's diff to the persistent batch, one forward pass over every
scheduled token, logits only for the rows that need them (sampling positions, prompt-logprob
positions), one batched sampling pass, one device-to-host copy of the results.

The only difference between CUDA and the CPU is the attention backend name (both use the torch
reference path today; a fused CUDA kernel can be registered and chosen here).
"""

from __future__ import annotations

import logging
import time

import torch

from common.config import ExecutorConfig, ModelGeometry
from common.input_batch import InputBatch, RequestState, ScheduledRow, StepBatch
from common.model_runner_base import ModelRunnerBase
from common.models import build_model
from common.sampling import (
    LogprobsTensors,
    Sampler,
    build_sampling_metadata,
    compute_prompt_logprobs,
)
from common.step_types import RequestStepOutput, SamplingParams, StepInput, StepOutput

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

#: Prompt-logprob positions projected to logits at a time (bounds the [P, vocab] temporaries).
_PROMPT_LOGPROB_SLICE = 512


def resolve_device(spec: str) -> torch.device:
    """"auto" -> the current CUDA device when there is one, else the CPU; a CUDA device always
    comes back with its index."""
    if spec == "auto":
        spec = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class GPUModelRunner(ModelRunnerBase):
    """Runs steps of a Llama-family model on a CUDA device or the CPU."""

    def __init__(self, config: ExecutorConfig, geometry: ModelGeometry):
        super().__init__(config, geometry)
        self.device = resolve_device(config.device)  # where weights, cache and batch live
        self.dtype = _DTYPES[config.dtype]  # weights / activations / KV dtype
        # The one device-specific choice: the attention implementation's registered name.
        self.attention_backend = "torch"
        self.kv_caches: list[torch.Tensor] = []  # one [2, blocks, block_size, kvh, d] per layer
        self.input_batch = InputBatch(config.block_size, geometry.vocab_size,
                                      geometry.max_model_len, self.device)
        self.sampler = Sampler(config.seed, self.device)  # noise for unseeded rows
        self.weights_bytes = 0  # set by load_model()

    # --- lifecycle ------------------------------------------------------------------------

    def load_model(self) -> None:
        """Build the model on the device and load its weights."""
        self.model = build_model(self.config.model, self.dtype, self.device,
                                 self.geometry.max_model_len)
        self.model.set_attention_backend(self.attention_backend)
        self.weights_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate num_blocks zeroed KV blocks per layer and bind them to the model."""
        g = self.geometry
        shape = (2, num_blocks, self.config.block_size, g.num_kv_heads, g.head_dim)
        self.kv_caches = []
        self.model.bind_kv_cache(None)
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(g.num_layers)]
        self.model.bind_kv_cache(self.kv_caches)
        self.num_blocks = num_blocks

    def reset(self) -> None:
        """Forget every request and restart unseeded sampling from the configured seed."""
        self.input_batch.clear()
        self.sampler.reseed(self.config.seed)

    # --- steps ----------------------------------------------------------------------------

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step; a request that fails (bad schedule, non-finite logits) gets an error
        and its state is dropped, the others are unaffected."""
        started = time.perf_counter()
        batch = self.input_batch.prepare(step)
        outputs = {rid: RequestStepOutput(rid, error=msg) for rid, msg in batch.errors.items()}
        if batch.rows:
            try:
                outputs.update(self._run(batch))
            except Exception as exc:  # the whole forward failed: fail this step's requests
                log.exception("step %d failed", step.step_id)
                for row in batch.rows:
                    rid = row.state.request_id
                    outputs[rid] = RequestStepOutput(rid, error=f"step failed: {exc!r}")
                    self.input_batch.remove(rid)
        order = [r.request_id for r in step.new_requests] + [
            r.request_id for r in step.cached_requests]
        ordered = [outputs.pop(rid) for rid in order if rid in outputs]
        return StepOutput(step_id=step.step_id, outputs=ordered,
                          device_seconds=time.perf_counter() - started)

    def _run(self, batch: StepBatch) -> dict[str, RequestStepOutput]:
        """Forward, logits, sampling and prompt logprobs of a validated batch."""
        hidden = self.model(batch.input_ids, batch.positions, batch.attn)
        # Per request: did any of its tokens produce a non-finite hidden state? (A sum is
        # finite exactly when every term is.)
        row_sums = torch.zeros(len(batch.rows), dtype=torch.float32, device=self.device)
        row_sums.index_add_(0, batch.token_rows, hidden.float().sum(dim=-1))
        sample_states = [batch.rows[i].state for i in batch.sample_rows]
        sampled: list[int] = []
        token_lps = []
        if sample_states:
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            logits_ok = logits.sum(dim=-1).isfinite()
            logits = logits.masked_fill(~logits_ok[:, None], 0.0)  # keep the batch sane
            meta = self._sampling_metadata(sample_states)
            result = self.sampler(logits, meta)
            if result.logprobs is not None:
                token_lps = result.logprobs.to_token_logprobs(meta.num_logprobs)
            sampled = result.sampled_token_ids.tolist()
            row_sums[batch.sample_rows] += torch.where(logits_ok, 0.0, float("nan"))
        failed = {i for i, ok in enumerate(row_sums.isfinite().tolist()) if not ok}
        prompt_lps = self._prompt_logprobs(hidden, batch) if batch.prompt_lp_rows else {}

        outputs: dict[str, RequestStepOutput] = {}
        for i, row in enumerate(batch.rows):
            rid = row.state.request_id
            if i in failed:
                outputs[rid] = RequestStepOutput(rid, error="non-finite values in the forward")
                self._scrub(batch, i)
                self.input_batch.remove(rid)
            else:
                outputs[rid] = RequestStepOutput(rid, prompt_logprobs=prompt_lps.get(rid, []))
        for j, i in enumerate(batch.sample_rows):
            if i not in failed:
                state = batch.rows[i].state
                out = outputs[state.request_id]
                out.sampled_token_id = sampled[j]
                out.logprobs = token_lps[j] if token_lps else None
                state.token_ids.append(sampled[j])
        return outputs

    def _scrub(self, batch: StepBatch, row: int) -> None:
        """Zero the KV slots a failed request wrote in this step, so that no non-finite value
        stays in the cache (attention relies on masked slots being finite)."""
        if not self.kv_caches:
            return
        qsl = batch.attn.query_start_loc_host
        slots = batch.attn.slot_mapping[qsl[row]:qsl[row + 1]]
        for cache in self.kv_caches:
            cache.view(2, -1, *cache.shape[3:])[:, slots] = 0

    def _sampling_metadata(self, states: list[RequestState]):
        """Sampling tensors of the sampling rows (token histories only for penalty rows)."""
        params = [s.sampling for s in states]
        pen = [p.has_penalties for p in params]
        return build_sampling_metadata(
            params, positions=[len(s.token_ids) for s in states],
            prompt_ids=[s.prompt_token_ids if pen[i] else () for i, s in enumerate(states)],
            output_ids=[s.output_token_ids if pen[i] else () for i, s in enumerate(states)],
            vocab_size=self.geometry.vocab_size, device=self.device,
            max_logprobs=self.config.max_logprobs,
            num_outputs=[s.num_output_tokens for s in states])

    def _prompt_logprobs(self, hidden: torch.Tensor, batch: StepBatch) -> dict[str, list]:
        """Prompt logprobs of the positions computed in this step, per request id."""
        rows = [batch.rows[i] for i in batch.prompt_lp_rows]
        ks = [min(r.state.sampling.prompt_logprobs, self.config.max_logprobs) for r in rows]
        k = max(ks)
        pieces = []
        total = batch.prompt_lp_indices.shape[0]
        for start in range(0, total, _PROMPT_LOGPROB_SLICE):
            sl = slice(start, start + _PROMPT_LOGPROB_SLICE)
            logits = self.model.compute_logits(hidden[batch.prompt_lp_indices[sl]])
            pieces.append(compute_prompt_logprobs(logits, batch.prompt_lp_targets[sl], k))
        merged = LogprobsTensors(*(torch.cat([getattr(p, f) for p in pieces]) for f in (
            "token_ids", "logprobs", "ranks", "top_ids", "top_logprobs")))
        per_position = [kk for r, kk in zip(rows, ks) for _ in range(r.num_prompt_logprobs)]
        flat = merged.to_token_logprobs(per_position)
        result, pos = {}, 0
        for r in rows:
            result[r.state.request_id] = flat[pos:pos + r.num_prompt_logprobs]
            pos += r.num_prompt_logprobs
        return result

    # --- profiling and warm-up ------------------------------------------------------------

    def dummy_run(self, num_tokens: int, num_reqs: int, prompt_logprobs: bool = False) -> None:
        """A forward pass plus worst-case sampling on fabricated inputs; no request state kept.

        Single-token shapes run against the bound cache writing only into block 0 (the
        controller's reserved null block); other shapes run without a cache (nothing written).
        """
        bs = self.config.block_size
        # No fabricated request may be longer than the model accepts.
        longest = max(1, self.geometry.max_model_len - bs)
        num_reqs = max(1, min(num_tokens, max(num_reqs, -(-num_tokens // longest))))
        decode = num_tokens == num_reqs and bool(self.kv_caches)
        rows = []
        for i in range(num_reqs):
            n = num_tokens // num_reqs + (1 if i < num_tokens % num_reqs else 0)
            computed = bs - 1 if decode else 0
            length = computed + n
            state = RequestState(f"dummy-{i}", [i % self.geometry.vocab_size] * length, length,
                                 [0] * -(-length // bs), _DUMMY_SAMPLING)
            rows.append(ScheduledRow(state, computed, n, True, 0))
        batch = self.input_batch.build(rows)
        if not decode:
            self.model.bind_kv_cache(None)
        try:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            meta = self._sampling_metadata([r.state for r in rows])
            Sampler(0, self.device)(logits, meta)
            if prompt_logprobs:
                n = min(num_tokens, _PROMPT_LOGPROB_SLICE)
                lp_logits = self.model.compute_logits(hidden[:n])
                compute_prompt_logprobs(lp_logits, batch.input_ids[:n], self.config.max_logprobs)
        finally:
            self.model.bind_kv_cache(self.kv_caches or None)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def profile_run(self) -> int:
        """Worst-case steps (max tokens over max requests, and max tokens in one prefill);
        returns the peak activation bytes on CUDA, 0 on the CPU (no allocator statistics)."""
        tokens = self.config.max_num_batched_tokens
        reqs = min(self.config.max_num_seqs, tokens)
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
        with torch.inference_mode():
            self.dummy_run(tokens, reqs, prompt_logprobs=True)
            self.dummy_run(tokens, 1)
        if not cuda:
            return 0
        return max(0, torch.cuda.max_memory_allocated(self.device) - base)

    def capture_model(self) -> int:
        """Warm up a prefill-shaped and a decode-shaped step; returns the graphs captured.

        No graphs are captured: the CPU has none, and CUDA graphs for decode batch sizes are not
        implemented yet (CUDA runs eagerly), so this returns 0.
        """
        with torch.inference_mode():
            self.dummy_run(min(64, self.config.max_num_batched_tokens), 1)
            batch = min(8, self.config.max_num_seqs)
            self.dummy_run(batch, batch)
        return 0


#: Worst-case sampling for dummy runs: random with every filter and logprobs.
_DUMMY_SAMPLING = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, min_p=0.01, logprobs=5,
                                 presence_penalty=0.1, repetition_penalty=1.1)
