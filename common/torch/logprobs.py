"""Logprobs of chosen tokens and their top alternatives, computed on the device.

The sampler (common.torch.sampling) and the runners' prompt logprobs use the same helper: the
log-softmax of the logits it is given (raw, or masked for a constrained request: the
constrained distribution), the chosen token's logprob and rank, and the best ``k``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from common.wire.step_types import TokenLogprobs


@dataclass
class LogprobsTensors:
    """Logprobs of chosen tokens and the top-k alternatives (device tensors, one row each)."""

    token_ids: torch.Tensor  # [N] int64 the chosen (sampled or prompt) tokens
    logprobs: torch.Tensor  # [N] float32 their log probabilities
    ranks: torch.Tensor  # [N] int64 their 1-based ranks
    top_ids: torch.Tensor  # [N, k] int64 best tokens, best first
    top_logprobs: torch.Tensor  # [N, k] float32 their log probabilities

    def to_token_logprobs(self, num_top: Sequence[int | None]) -> list[TokenLogprobs | None]:
        """Host objects, each trimmed to its row's ``num_top`` (None rows give None)."""
        ids, lps = self.token_ids.tolist(), self.logprobs.tolist()
        ranks, top_ids, top_lps = (
            self.ranks.tolist(),
            self.top_ids.tolist(),
            self.top_logprobs.tolist(),
        )
        out: list[TokenLogprobs | None] = []
        for i, k in enumerate(num_top):
            if k is None:
                out.append(None)
                continue
            # Best first: a -inf entry and all after it are tokens of probability 0 (masked).
            row = top_lps[i][:k]
            k = next((j for j, lp in enumerate(row) if lp == -math.inf), len(row))
            out.append(TokenLogprobs(ids[i], lps[i], ranks[i], top_ids[i][:k], row[:k]))
        return out


def compute_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobsTensors:
    """Logprob, rank and top-k of ``token_ids`` [N] under raw ``logits`` [N, V] (k >= 0)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    token_lp = lp.gather(1, token_ids[:, None])[:, 0]
    ranks = (lp > token_lp[:, None]).sum(dim=-1) + 1
    top_lp, top_ids = lp.topk(k, dim=-1) if k > 0 else (lp[:, :0], token_ids[:, None][:, :0])
    return LogprobsTensors(
        token_ids=token_ids, logprobs=token_lp, ranks=ranks, top_ids=top_ids, top_logprobs=top_lp
    )


def compute_prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> LogprobsTensors:
    """Prompt logprobs: row i holds the logits at prompt position i and ``next_token_ids[i]``
    is the prompt token at i+1; returns its logprob, rank and the top-k there."""
    return compute_logprobs(logits, next_token_ids, k)
