"""Allowed-token masks (structured output) with static shapes.

A constrained request's step carries its allowed tokens as packed bits (common.wire.step_types.
token_mask_bytes: little-endian uint32 words, bit t % 32 of word t // 32 set when token t may be
sampled). The runner stacks a masked step's rows into one ``[request bucket, words]`` int32
array, every bit set for unconstrained and padding rows, and the sampling program unpacks it on
the device: 4 bytes per 32 tokens travel, not a byte per token.

A request's mask is its row state's ``allowed_token_mask`` (this step's, replaced by every step;
the executor's step check has refused wrong lengths and masks allowing nothing).
"""

from __future__ import annotations

import numpy as np
import torch

from common.wire.step_types import token_mask_bytes

#: Words of an unconstrained row: every bit set.
ALL_ALLOWED = -1
#: Each bit of an int32 word as an int32 value, bit 0 first.
_BITS = [1 << b for b in range(31)] + [-(2**31)]


def mask_words(masks: list[bytes | None], request_bucket: int, vocab_size: int) -> np.ndarray:
    """``[request_bucket, words]`` int32 packed words: row i from ``masks[i]`` (a correct
    length: the step check refuses others), every bit set where it is None and on padding rows."""
    words = token_mask_bytes(vocab_size) // 4
    out = np.full((request_bucket, words), ALL_ALLOWED, np.int32)
    for i, mask in enumerate(masks):
        if mask is not None:
            out[i] = np.frombuffer(mask, dtype="<i4", count=words)
    return out


def allowed_tokens(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, vocab_size] bool from packed int32 words [R, W], on the words' device (an
    elementwise AND with each bit: no data-dependent shape)."""
    # AND with single-bit constants, not shifts: XLA:CPU's right shift of a negative int32 (a
    # word with bit 31 set) lost its bits here; bit 31 itself is the int32 minimum.
    bit = torch.tensor(_BITS, dtype=torch.int32, device=words.device)
    bits = words[:, :, None] & bit
    return bits.reshape(words.shape[0], -1)[:, :vocab_size] != 0


def apply_mask(
    logits: torch.Tensor, row_ok: torch.Tensor, words: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Disallowed tokens' logits at -inf; a row whose mask allows no token (the step check
    refuses those: a backstop) is not ok, failing instead of sampling a forbidden token."""
    allowed = allowed_tokens(words, logits.shape[1])
    return logits.masked_fill(~allowed, float("-inf")), row_ok & allowed.any(dim=-1)
