"""Incremental detokenization for byte-level BPE tokenizers (GPT-2's scheme: Llama 3, Qwen,
SmolLM, ...) without decoding any window of tokens.

Such a tokenizer's decoder is `ByteLevel` alone: every token stands for a fixed byte string
and the text is those bytes decoded as UTF-8, invalid sequences replaced by U+FFFD. The
`tokenizers` library's `decode` does, per id: skip a special token when asked to; put an added
token's content in verbatim, ending the bytes before it (decoded on their own, so a character
left incomplete there becomes U+FFFD); drop an id the model does not know; and append every
other token's bytes. So the text grows by table look-ups and an incremental UTF-8 decoder (C):
a fraction of a window decode per token, and no work that grows with the output.

The deltas are those of `IncrementalDetokenizer`: each step returns all the text not yet
returned unless it ends in U+FFFD or in bytes of an unfinished character (then it waits for the
next step, or for the end).
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Sequence
from functools import lru_cache

from controller.text.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


def _unicode_to_byte() -> dict[str, int]:
    """GPT-2's byte <-> printable character map, inverted: each of the 256 bytes is one
    character in token strings (printable bytes as themselves, the others shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + shifted)] = b
            shifted += 1
    return chars


def _token_bytes(token: str, char_bytes: dict[str, int]) -> bytes:
    """A token's bytes as the ByteLevel decoder gives them: mapped character by character, or
    the token's own UTF-8 when one of its characters is outside the map."""
    try:
        return bytes(char_bytes[c] for c in token)
    except KeyError:
        return token.encode("utf-8")


@lru_cache(maxsize=16)
def byte_level_table(tokenizer: Tokenizer, skip_special_tokens: bool) -> list | None:
    """Per id: its bytes (b"" when decoding drops it), or its text (an added token, put in
    verbatim). None when the tokenizer's decoder is not `ByteLevel` alone. Cached per
    tokenizer and flag: built once (tens of milliseconds), shared by every request."""
    backend = tokenizer.backend
    decoder = backend.decoder
    if decoder is None or json.loads(decoder.__getstate__()).get("type") != "ByteLevel":
        return None
    char_bytes = _unicode_to_byte()
    table: list = [b""] * tokenizer.vocab_size
    for token, token_id in backend.get_vocab(with_added_tokens=False).items():
        if 0 <= token_id < len(table):
            table[token_id] = _token_bytes(token, char_bytes)
    for token_id, added in backend.get_added_tokens_decoder().items():
        if 0 <= token_id < len(table):
            skipped = skip_special_tokens and added.special
            table[token_id] = b"" if skipped else added.content
    return table


class ByteLevelDetokenizer:
    """`IncrementalDetokenizer`'s contract (same `step`, same deltas) by table look-up."""

    def __init__(self, table: list) -> None:
        self._table = table  # per id: bytes, or an added token's text (byte_level_table)
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds partial chars
        self._ids: list[int] = []  # every output token id so far
        self._held = ""  # decoded text not returned yet: it ends in U+FFFD

    @property
    def token_ids(self) -> list[int]:
        """The output token ids seen so far."""
        return self._ids

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Append new ids and return the text they complete; `finished` flushes held text."""
        self._ids.extend(new_token_ids)
        table, size, utf8 = self._table, len(self._table), self._utf8
        pieces = [table[i] if 0 <= i < size else b"" for i in new_token_ids]
        text = self._held
        if len(pieces) > 1 and all(type(p) is bytes for p in pieces):
            text += utf8.decode(b"".join(pieces))  # many ids (a whole output at once): one call
        else:
            for piece in pieces:
                if type(piece) is bytes:
                    text += utf8.decode(piece)
                else:  # the bytes before an added token are decoded on their own
                    text += utf8.decode(b"", True) + piece
        if finished:
            self._held = ""
            return text + utf8.decode(b"", True)
        if utf8.getstate()[0] or text.endswith(_REPLACEMENT_CHAR):
            self._held = text  # a character may be incomplete: wait for the next step
            return ""
        self._held = ""
        return text
