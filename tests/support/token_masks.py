"""Allowed-token masks for tests, in the wire's packed form (common.wire.step_types)."""

from __future__ import annotations

from collections.abc import Iterable

from common.wire.step_types import token_mask_bytes


def pack_mask(allowed: Iterable[int], vocab_size: int) -> bytes:
    """The packed mask allowing exactly ``allowed``: bit t of the little-endian bytes (little-
    endian uint32 words) set for each allowed token t."""
    bits = 0
    for t in allowed:
        bits |= 1 << t
    return bits.to_bytes(token_mask_bytes(vocab_size), "little")


def unpack_mask(mask: bytes, vocab_size: int) -> set[int]:
    """The tokens a packed mask allows (below ``vocab_size``)."""
    bits = int.from_bytes(mask, "little")
    return {t for t in range(vocab_size) if bits >> t & 1}
