"""The characters one token can cover: a sound bound for byte-level and SentencePiece-style
tokenizers, none for tokenizers that can drop input."""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers

from controller.text.text_bound import chars_per_token_bound, text_limit
from controller.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def test_default_model_bound_holds_on_any_text(tok: Tokenizer) -> None:
    bound = chars_per_token_bound(tok.backend)
    assert bound is not None and 10 < bound < 200
    rng = random.Random(5)
    samples = [" " * 5000, "#" * 5000, "\n" * 3000, "<|im_start|>" * 50, "é漢🙂 " * 300]
    samples.append("".join(chr(rng.randint(32, 0x2FFF)) for _ in range(3000)))
    for text in samples:
        tokens = len(tok.encode(text, add_special_tokens=False))
        assert len(text) <= tokens * bound, (text[:20], tokens)
        assert len(text) <= text_limit(tokens, bound)


def _backend(normalizer=None, pre_tokenizer=None) -> BackendTokenizer:
    backend = BackendTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    if normalizer is not None:
        backend.normalizer = normalizer
    if pre_tokenizer is not None:
        backend.pre_tokenizer = pre_tokenizer
    return backend


def test_tokenizers_that_drop_input_get_no_bound() -> None:
    assert chars_per_token_bound(_backend()) == 5  # "[UNK]"
    assert chars_per_token_bound(_backend(normalizers.NFC())) == 20  # composition: 4 to 1
    assert chars_per_token_bound(_backend(normalizers.StripAccents())) is None
    assert chars_per_token_bound(_backend(pre_tokenizer=pre_tokenizers.Whitespace())) is None
    keeping = pre_tokenizers.Sequence([pre_tokenizers.ByteLevel(), pre_tokenizers.Digits()])
    assert chars_per_token_bound(_backend(pre_tokenizer=keeping)) == 5
    assert chars_per_token_bound(None) is None
    assert text_limit(10, None) is None
