"""Rotary position embeddings: the inverse frequencies of a RoPE configuration (plain,
``linear`` and ``llama3`` scaling) and the per-model cos/sin table the layers index."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: dict[str, Any] | None
) -> tuple[torch.Tensor, float]:
    """RoPE inverse frequencies (float32, [head_dim/2]) and the position divisor.

    Supports plain RoPE, ``linear`` scaling (positions divided by the factor) and ``llama3``
    scaling (long wavelengths slowed by the factor, a smooth blend in between).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv_freq, float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        blend = ((old_len / wavelen) - low) / (high - low)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        middle = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        return torch.where(middle, blended, scaled), 1.0
    raise NotImplementedError(f"RoPE scaling type {kind!r} is not supported")


class RotaryEmbedding(nn.Module):
    """Rotary position embedding (half-split rotation) from a precomputed cos/sin table."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ):
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.rebuild()

    def rebuild(self, device: torch.device | str | None = None) -> None:
        """(Re)compute the float32 table [max_positions, head_dim] of cos | sin halves."""
        if device is None:
            device = self.cos_sin.device if self.cos_sin.device.type != "meta" else "cpu"
        inv_freq, divisor = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        pos = torch.arange(self.max_positions, dtype=torch.float32, device="cpu") / divisor
        freqs = pos[:, None] * inv_freq[None, :]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
