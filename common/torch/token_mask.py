"""Structured output on the device: a step's allowed-token masks applied to its logits.

The controller owns the grammar and sends, for each constrained request and only in a step
where it samples, the tokens it may sample as packed bits (common.wire.step_types.
token_mask_bytes: little-endian uint32 words, bit t % 32 of word t // 32 for token t). The
packed bytes cross to the device as they are (1/32 of an unpacked bool matrix) and are unpacked
there: read as bytes, that layout puts token t at bit t % 8 of byte t // 8, so one shift by
``arange(8)`` per byte unpacks every word. Disallowed logits become -inf before anything else
in sampling, so greedy, random sampling and logprobs all see the constrained distribution.

A step without a mask builds nothing here (the sampler's metadata holds None).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def mask_tensors(
    masks: Sequence[bytes | None] | None, device: torch.device | str
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The masked rows among a step's sampling rows and their packed masks on the device:
    (rows [M] int64, or None when every row is masked; masks [M, B] uint8). (None, None) when
    no row has a mask. Every mask holds the same B bytes (the executor's step check)."""
    masked = [i for i, m in enumerate(masks or ()) if m]
    if not masked:
        return None, None
    joined = bytearray(b"".join(masks[i] for i in masked))  # a writable buffer for frombuffer
    packed = torch.frombuffer(joined, dtype=torch.uint8).view(len(masked), -1).to(device)
    if len(masked) == len(masks):
        return None, packed
    return torch.tensor(masked, dtype=torch.int64, device=device), packed


def unpack_allowed(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[M, vocab_size] bool: which tokens each packed mask [M, B] uint8 allows (on its device;
    the padding bits past the vocabulary are dropped)."""
    shifts = torch.arange(8, dtype=torch.uint8, device=packed.device)
    bits = (packed[:, :, None] >> shifts) & 1  # [M, B, 8]: byte b's bit j is token 8b + j
    return bits.view(packed.shape[0], -1)[:, :vocab_size].bool()


def apply_token_masks(
    logits: torch.Tensor, rows: torch.Tensor | None, packed: torch.Tensor
) -> torch.Tensor:
    """Logits [S, V] with every token a row's mask disallows at -inf (a new tensor). ``rows``
    [M] are the masked rows (None: all S, in order), ``packed`` [M, B] their masks."""
    allowed = unpack_allowed(packed, logits.shape[1])
    if rows is None:
        return logits.masked_fill(~allowed, float("-inf"))
    return logits.index_copy(0, rows, logits[rows].masked_fill(~allowed, float("-inf")))


def keep_some_token(logits: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Rows of ``logits`` left with no finite value take ``fallback``'s row instead: a grammar
    that allows only a stop token wins over min_tokens' suppression of it."""
    dead = torch.isneginf(logits).all(dim=-1, keepdim=True)
    return torch.where(dead, fallback, logits)
