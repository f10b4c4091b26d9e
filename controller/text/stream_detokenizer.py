"""Incremental detokenization in Rust: the `tokenizers` library's `DecodeStream`.

The per-token step of `IncrementalDetokenizer` (controller/text/detokenizer.py) is a few list
and string operations around one Rust decode; at hundreds of streams per step they are a tenth
of the controller's CPU. `DecodeStream` keeps the same window in Rust (the tokens since the
emission before last, as text-generation-inference does): one call per step, about half the
CPU per token. The text is the same, delta for delta: both return, per step, everything that
decodes up to now unless it ends in an incomplete character (U+FFFD), with the window's text
minus the text of its first tokens.

It is used where that holds without condition: the decoder does not merge runs of `<0xNN>`
byte tokens (`ByteFallback`, where a later byte token can turn text already returned into
replacement characters, and the Python detokenizer waits for the run to end). Anything the
stream refuses later (its "invalid prefix" error, an older library) hands the request over
to the Python detokenizer, seeded with what was returned so far.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from controller.text.tokenizer import Tokenizer

try:  # tokenizers >= 0.21
    from tokenizers.decoders import DecodeStream
except ImportError:  # pragma: no cover - older tokenizers: the Python detokenizer only
    DecodeStream = None


def stream_decoding_fits(byte_fallback_ids: frozenset[int]) -> bool:
    """Whether `StreamDetokenizer` returns exactly `IncrementalDetokenizer`'s text for a
    tokenizer: the library has `DecodeStream` and the decoder merges no byte-token runs (the
    tokenizer's `<0xNN>` ids that do, from `detokenizer.byte_fallback_ids`, are none)."""
    return DecodeStream is not None and not byte_fallback_ids


class Detokenizer(Protocol):
    """What the fallback detokenizer offers (controller/text/detokenizer.py's)."""

    @property
    def token_ids(self) -> list[int]:
        """The output token ids seen so far."""

    def seed(self, ids: Sequence[int]) -> None:
        """Start after `ids`, whose text has been returned already."""

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Append new ids and return the text they complete."""


class StreamDetokenizer:
    """`IncrementalDetokenizer`'s contract (same `step`, same deltas) on `DecodeStream`.

    Besides the stream it keeps the ids and two offsets, both on emission boundaries: `_read`
    (tokens whose text has been returned) and `_last_read` (the emission before), which is
    where the stream's own window starts. Held tokens at the end (an incomplete character, a
    skipped special token) are flushed by decoding that window, as the stream would.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        fallback: Callable[[Tokenizer, bool], Detokenizer],
    ) -> None:
        self._tokenizer = tokenizer  # for the Python fallback
        self._make_fallback = fallback  # builds the Python detokenizer, if the stream refuses
        self._backend = tokenizer.backend  # the Rust tokenizer the stream decodes with
        self._decode = tokenizer.backend.decode  # raw decode, for the flush at the end
        self._skip_special_tokens = skip_special_tokens  # drop special tokens from the text
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)  # the Rust window
        self._ids: list[int] = []  # every output token id so far
        self._read = 0  # tokens whose text has been returned
        self._last_read = 0  # `_read` before the latest emission: the stream's window start
        self._fallback: Detokenizer | None = None  # set if the stream refused

    @property
    def token_ids(self) -> list[int]:
        """The output token ids seen so far."""
        return self._ids if self._fallback is None else self._fallback.token_ids

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Append new ids and return the text they complete; `finished` flushes held text."""
        if self._fallback is not None:
            return self._fallback.step(new_token_ids, finished)
        ids = self._ids
        delta = ""
        if new_token_ids:
            ids.extend(new_token_ids)
            try:
                piece = self._stream.step(self._backend, list(new_token_ids))
            except Exception:  # the stream's invalid-prefix error, or an older signature
                return self._fall_back(finished)
            if piece is not None:
                self._last_read, self._read = self._read, len(ids)
                delta = piece
        if finished and self._read < len(ids):
            delta += self._flush()
        return delta

    def _flush(self) -> str:
        """The text of the held tokens, incomplete characters included: the stream's window
        decoded whole, minus the text of its part already returned."""
        start, skip = self._last_read, self._skip_special_tokens
        text = self._decode(self._ids[start:], skip_special_tokens=skip)
        returned = self._decode(self._ids[start : self._read], skip_special_tokens=skip)
        self._last_read, self._read = self._read, len(self._ids)
        return text[len(returned) :]

    def _fall_back(self, finished: bool) -> str:
        """Continue on the Python detokenizer, its window over every id so far with the text
        returned until now as its prefix (one long decode, once), and return this step's
        delta from it."""
        fallback = self._make_fallback(self._tokenizer, self._skip_special_tokens)
        held = self._ids[self._read :]
        fallback.seed(self._ids[: self._read])
        self._fallback = fallback
        return fallback.step(held, finished)
