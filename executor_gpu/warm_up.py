"""The GPU runner's fabricated steps: the worst-case step that sizes the KV cache, warm-up, and
the capture of decode graphs (``GPUModelRunner`` inherits them)."""

from __future__ import annotations

import torch

from common.torch.attention import AttentionMetadata
from common.torch.runner import DUMMY_SAMPLING
from common.torch.sampling import Sampler, compute_prompt_logprobs
from common.wire.step_types import token_mask_bytes
from executor_gpu.cuda.graphs import DecodeGraphs, capture_sizes

#: Prompt-logprob positions projected to logits at a time (bounds the [P, vocab] temporaries).
PROMPT_LOGPROB_SLICE = 512


class WarmUp:
    """Profiling, warm-up and graph capture of a torch runner on CUDA or the CPU (a mixin of
    ``GPUModelRunner``, whose model, cache, batch and sampling metadata it uses)."""

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
        rows = self.dummy_rows(num_tokens, num_reqs, bs - 1 if decode else 0, DUMMY_SAMPLING)
        full = b"\xff" * token_mask_bytes(self.geometry.vocab_size)
        for row in rows:  # the worst case masks every row too (structured output)
            row.state.allowed_token_mask = full
        batch = self.input_batch.build(rows)
        if not decode:
            self.model.bind_kv_cache(None)
        try:
            hidden = self.model(batch.input_ids, batch.positions, batch.attn)
            logits = self.model.compute_logits(hidden[batch.logits_indices])
            meta = self._sampling_metadata([r.state for r in rows])
            Sampler(0, self.device)(logits, meta)
            if prompt_logprobs:
                n = min(num_tokens, PROMPT_LOGPROB_SLICE)
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

    def decode_forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and logits of a pure decode step (what the decode graphs capture)."""
        hidden = self.model(input_ids, positions, meta)
        return hidden, self.model.compute_logits(hidden)

    def enable_decode_graphs(self, capture: bool = True) -> int:
        """Set up decode replay for batch sizes up to max_num_seqs (captured on CUDA; with
        capture=False, the same static-buffer path run eagerly); returns the graphs made."""
        bs = self.config.block_size
        self.graphs = DecodeGraphs(
            self.decode_forward,
            capture_sizes(self.config.max_num_seqs),
            -(-self.geometry.max_model_len // bs),
            bs,
            self.device,
            capture=capture,
        )
        with torch.inference_mode():
            return self.graphs.capture_all()

    def capture_model(self) -> int:
        """Warm up a prefill-shaped and a decode-shaped step, then, on CUDA with the Triton
        kernels, capture the decode graphs; returns the graphs captured (0 on the CPU)."""
        with torch.inference_mode():
            self.dummy_run(min(64, self.config.max_num_batched_tokens), 1)
            batch = min(8, self.config.max_num_seqs)
            self.dummy_run(batch, batch)
        if self.device.type != "cuda" or self.fused_ops is None or not self.kv_caches:
            return 0
        if self.tp.size > 1:  # the followers would have to capture theirs in step: eager
            return 0
        return self.enable_decode_graphs()
