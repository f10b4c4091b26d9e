"""The latency model of a simulated step: how long a step of a given shape takes."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass
class LatencyModel:
    """Step time = fixed + per token + per request + per context token, with optional jitter."""

    fixed_s: float = 0.005  # seconds every step costs (launch, sync, sampling)
    per_token_s: float = 20e-6  # seconds per scheduled token (the forward's matmuls)
    per_request_s: float = 0.0  # seconds per scheduled request (batch bookkeeping)
    per_context_token_s: float = 0.0  # seconds per token attended to (KV read in attention)
    jitter: float = 0.0  # uniform relative noise: each step is scaled by 1 +- jitter

    def seconds(
        self,
        num_tokens: int,
        num_requests: int,
        num_context_tokens: int = 0,
        rng: random.Random | None = None,
    ) -> float:
        """Modeled duration of a step with these scheduled tokens, requests and context."""
        base = (
            self.fixed_s
            + self.per_token_s * num_tokens
            + self.per_request_s * num_requests
            + self.per_context_token_s * num_context_tokens
        )
        if self.jitter > 0 and rng is not None:
            base *= 1.0 + rng.uniform(-self.jitter, self.jitter)
        return max(0.0, base)
