"""How much text a token can cover: a bound that refuses oversized text before tokenizing it.

Tokenizing costs time linear in the text, on the event loop (a 3 MB text takes seconds).
When every token covers at most C characters of the input, a text of more than ``T * C``
characters has more than T tokens, so it can be refused at once without being tokenized. That
holds for the tokenizers of today's LLMs: byte-level BPE (a token is a byte string, its
vocabulary entry one character per byte, and a character takes at least one byte) and
SentencePiece-style vocabularies (an entry is its text, ``▁`` for a space), as long as nothing
before the model removes input: a normalizer may only keep or lengthen the text (Unicode
composition shortens by at most 4 to 1), a pre-tokenizer may only split it. Any other
tokenizer gets no bound (None), and only the body size bounds its text.
"""

from __future__ import annotations

import json
from typing import Any

# Unicode composition (NFC, NFKC) merges at most this many characters into one: a base letter
# and up to three combining marks (e.g. U+1F87, alpha with psili, perispomeni, ypogegrammeni).
_COMPOSITION_SHRINK = 4
# Pre-tokenizers that split the text without dropping any of it.
_KEEPING_PRE_TOKENIZERS = frozenset(
    {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts", "Split", "Sequence"}
)


def _normalizer_shrink(spec: dict[str, Any] | None) -> int | None:
    """How many times shorter a normalizer can make a text (None: without bound)."""
    if spec is None:
        return 1
    kind = spec.get("type")
    if kind in ("NFC", "NFKC"):
        return _COMPOSITION_SHRINK
    if kind in ("NFD", "NFKD", "Prepend", "Lowercase"):
        return 1
    if kind == "Replace":
        pattern = spec.get("pattern", {}).get("String")
        content = spec.get("content", "")
        return 1 if isinstance(pattern, str) and len(content) >= len(pattern) else None
    if kind == "Sequence":
        total = 1
        for part in spec.get("normalizers", []):
            shrink = _normalizer_shrink(part)
            if shrink is None:
                return None
            total *= shrink
        return total
    return None


def _keeps_all_text(spec: dict[str, Any] | None) -> bool:
    """Whether a pre-tokenizer keeps every character (splits, never drops)."""
    if spec is None:
        return True
    kind = spec.get("type")
    if kind not in _KEEPING_PRE_TOKENIZERS:
        return False
    if kind == "Split" and spec.get("behavior") == "Removed":
        return False
    if kind == "Sequence":
        return all(_keeps_all_text(p) for p in spec.get("pretokenizers", []))
    return True


def chars_per_token_bound(backend: Any) -> int | None:
    """The most characters of input one token of this `tokenizers.Tokenizer` can cover, or None
    when the tokenizer can drop input (then no such bound exists)."""
    if backend is None or not hasattr(backend, "to_str"):
        return None
    spec = json.loads(backend.to_str())
    shrink = _normalizer_shrink(spec.get("normalizer"))
    if shrink is None or not _keeps_all_text(spec.get("pre_tokenizer")):
        return None
    longest = max((len(entry) for entry in backend.get_vocab(with_added_tokens=True)), default=1)
    return max(1, longest) * shrink


def text_limit(tokens: int, chars_per_token: int | None) -> int | None:
    """The most characters a text of at most `tokens` tokens can have (None: no bound)."""
    return None if chars_per_token is None else tokens * chars_per_token
