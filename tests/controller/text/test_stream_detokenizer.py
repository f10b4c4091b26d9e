"""The fast detokenizers against the Python one (controller/text/detokenizer.py): the Rust
stream (stream_detokenizer.py) and the byte-level table (byte_level.py) give the same delta at
every step, over random token ids, chunkings and tokenizers."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest

import controller.text.detokenizer as detokenizer_module
from controller.text.byte_level import ByteLevelDetokenizer, byte_level_table
from controller.text.detokenizer import IncrementalDetokenizer, OutputTextState, make_detokenizer
from controller.text.stream_detokenizer import DecodeStream, StreamDetokenizer
from controller.text.tokenizer import Tokenizer

MODEL_DIR = Path(
    os.environ.get("TANDEM_MODEL_DIR", "/root/.cache/tandem/models/SmolLM2-135M-Instruct")
).expanduser()
if not (MODEL_DIR / "tokenizer.json").is_file():
    pytest.skip(f"model directory {MODEL_DIR} not found", allow_module_level=True)
if DecodeStream is None:
    pytest.skip("tokenizers has no DecodeStream", allow_module_level=True)

TEXT = (
    "Hello 世界! 🎉🎉 Ünïcödé, Ελληνικά, русский, العربية, 한국어, 👩‍👩‍👧 family; "
    "math ∑∫√ and emoji 🏴‍☠️🇫🇷 — done.\n  Next line: 東京タワー 🗼 <|im_end|> tail"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def _chunks(ids: list[int], rng: random.Random, max_chunk: int) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, max_chunk)
        out.append(ids[i : i + k])
        i += k
    return out


FAST = ["stream", "byte_level"]


def _fast(tok: Tokenizer, kind: str, skip: bool = True):
    if kind == "stream":
        return StreamDetokenizer(tok, skip, IncrementalDetokenizer)
    table = byte_level_table(tok, skip)
    assert table is not None, "expected a byte-level tokenizer"
    return ByteLevelDetokenizer(table)


def _both(
    tok: Tokenizer, chunks: list[list[int]], skip: bool, kind: str = "stream"
) -> tuple[list[str], list[str]]:
    """Per-step deltas of a fast and of the Python detokenizer (the last step finishes)."""
    stream = _fast(tok, kind, skip)
    python = IncrementalDetokenizer(tok, skip)
    steps = [*chunks, []]
    done = len(steps) - 1
    a = [stream.step(c, finished=n == done) for n, c in enumerate(steps)]
    b = [python.step(c, finished=n == done) for n, c in enumerate(steps)]
    return a, b


def _random_ids(tok: Tokenizer, rng: random.Random, pieces: list[int]) -> list[int]:
    """Random vocabulary ids, special tokens and pieces of multi-byte characters, shuffled."""
    ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 50))]
    ids += [rng.randrange(20) for _ in range(rng.randint(0, 4))]  # special tokens
    ids += [rng.choice(pieces) for _ in range(rng.randint(0, 6))]
    rng.shuffle(ids)
    return ids


@pytest.mark.parametrize("kind", FAST)
@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_same_deltas_as_python(tok: Tokenizer, skip: bool, kind: str) -> None:
    rng = random.Random(23)
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = [i for i in text_ids if tok.decode([i]).endswith("\ufffd")]
    assert pieces, "expected tokens that hold part of a character"
    for _ in range(600):
        ids = _random_ids(tok, rng, pieces)
        a, b = _both(tok, _chunks(ids, rng, rng.choice([1, 2, 5])), skip, kind)
        assert a == b
        assert "".join(a) == tok.decode(ids, skip)


@pytest.mark.parametrize("kind", FAST)
def test_multibyte_text_token_by_token(tok: Tokenizer, kind: str) -> None:
    ids = tok.encode(TEXT * 5, add_special_tokens=False)
    rng = random.Random(3)
    for cut in [len(ids), *(rng.randrange(1, len(ids)) for _ in range(40))]:
        a, b = _both(tok, [[i] for i in ids[:cut]], True, kind)
        assert a == b and "".join(a) == tok.decode(ids[:cut])
        assert not any("\ufffd" in d for d in a[:-1])


@pytest.mark.parametrize("kind", FAST)
def test_ends_on_held_tokens(tok: Tokenizer, kind: str) -> None:
    """An end of special tokens or half a character is flushed as the full decode has it."""
    eos = tok.eos_token_id
    half = tok.encode("ok 🎉", add_special_tokens=False)[:-1]
    for ids in ([*tok.encode("Hi", add_special_tokens=False), eos], half, [eos], half + [eos]):
        for skip in (True, False):
            a, b = _both(tok, [[i] for i in ids], skip, kind)
            assert a == b and "".join(a) == tok.decode(ids, skip)


class _Refusing:
    """A DecodeStream that raises from its call number `fail_at` + 1 on."""

    def __init__(self, real: DecodeStream, fail_at: int) -> None:
        self.real, self.fail_at, self.calls = real, fail_at, 0

    def step(self, backend, new):
        self.calls += 1
        if self.calls > self.fail_at:
            raise Exception("Invalid prefix encountered")
        return self.real.step(backend, new)


def test_stream_refusal_falls_back_to_python(tok: Tokenizer) -> None:
    """If the Rust stream raises mid-output, the Python detokenizer takes over seamlessly."""
    rng = random.Random(9)
    ids = tok.encode(TEXT * 3, add_special_tokens=False)
    chunks = _chunks(ids, rng, 3)
    for fail_at in (0, 1, 7, 40, len(chunks) - 1):
        det = _fast(tok, "stream")
        det._stream = _Refusing(det._stream, fail_at)
        out = [det.step(c) for c in chunks] + [det.step([], finished=True)]
        python = IncrementalDetokenizer(tok)
        expected = [python.step(c) for c in chunks] + [python.step([], finished=True)]
        assert "".join(out) == "".join(expected) == tok.decode(ids)
        assert det._fallback is not None and det.token_ids == ids


def _metaspace_tokenizer(tmp_path: Path, prepend: str) -> Tokenizer:
    """A SentencePiece-style tokenizer without byte tokens: the first space is trimmed."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>", "\u2581", "\u2581hello", "\u2581world", "he", "llo", "!"]
    pieces += ["\u2581\u4e2d", "\u6587", "a", "b", "\u2581a", "\u2581\u2581"]
    backend = Backend(models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    backend.decoder = decoders.Metaspace("\u2581", prepend_scheme=prepend)
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("prepend", ["always", "first", "never"])
@pytest.mark.parametrize("skip", [True, False])
def test_word_marker_tokenizer(tmp_path: Path, prepend: str, skip: bool) -> None:
    tok = _metaspace_tokenizer(tmp_path, prepend)
    rng = random.Random(4)
    for _ in range(400):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 25))]
        a, b = _both(tok, _chunks(ids, rng, 3), skip)
        assert a == b and "".join(a) == tok.decode(ids, skip)


def test_byte_fallback_tokenizer_keeps_python(tmp_path: Path) -> None:
    """A decoder that merges `<0xNN>` runs stays on the Python detokenizer."""
    from tests.controller.text.test_detokenizer import _byte_fallback_tokenizer

    tok = _byte_fallback_tokenizer(tmp_path, "metaspace")
    assert isinstance(make_detokenizer(tok), IncrementalDetokenizer)


def test_choice_per_tokenizer(tok: Tokenizer, tmp_path: Path) -> None:
    """Byte-level BPE takes the table, a word-marker tokenizer the Rust stream."""
    assert isinstance(make_detokenizer(tok), ByteLevelDetokenizer)
    assert isinstance(make_detokenizer(_metaspace_tokenizer(tmp_path, "first")), StreamDetokenizer)


def _byte_level_tokenizer(tmp_path: Path) -> Tokenizer:
    """A byte-level BPE with added tokens, special and not, and ids the model lacks."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(alphabet))}
    for word in ["\u0120hello", "\u0120w", "or", "ld", "\u00e4\u00b8", "\u0138"]:
        vocab.setdefault(word, len(vocab))
    backend = Backend(models.BPE(vocab, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<|end|>", "<|start|>"])
    backend.add_tokens(["<tool>"])  # added, not special: always in the text
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end|>"}))
    return Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("skip", [True, False])
def test_byte_level_added_tokens(tmp_path: Path, skip: bool) -> None:
    """Added tokens cut the bytes before them (a character left incomplete there is U+FFFD),
    skipped special tokens do not; ids beyond the vocabulary decode to nothing."""
    tok = _byte_level_tokenizer(tmp_path)
    assert isinstance(make_detokenizer(tok), ByteLevelDetokenizer)
    added = [tok.token_to_id(t) for t in ("<|end|>", "<|start|>", "<tool>")]
    pieces = tok.encode("h\u4e16 \U0001f600 \u00e9", add_special_tokens=False)
    rng = random.Random(8)
    for _ in range(500):
        pool = [*added, *pieces, *range(tok.vocab_size)]
        ids = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        a, b = _both(tok, _chunks(ids, rng, 3), skip, "byte_level")
        assert a == b and "".join(a) == tok.decode(ids, skip)


def test_output_state_same_as_python_path(tok: Tokenizer, monkeypatch) -> None:
    """Stop strings and hold-back over the fast path give what they give over the Python one."""
    rng = random.Random(12)
    words = tok.encode(TEXT + " stop here. END of it", add_special_tokens=False)

    def run(ids: list[int], chunks: list[list[int]], stop: list[str]) -> tuple[list, str]:
        state = OutputTextState(tok, None, stop=stop)
        out = [state.update(c, finished=n == len(chunks) - 1) for n, c in enumerate(chunks)]
        return out, state.text

    for _ in range(150):
        ids = [rng.choice(words) for _ in range(rng.randint(1, 40))]
        chunks = _chunks(ids, rng, 3)
        stop = rng.choice([[], ["END"], [". ", "\u4e16"], ["o"]])
        fast = run(ids, chunks, stop)
        with monkeypatch.context() as patch:
            patch.setattr(detokenizer_module, "stream_decoding_fits", lambda _ids: False)
            patch.setattr(detokenizer_module, "byte_level_table", lambda *_args: None)
            slow = run(ids, chunks, stop)
        assert fast == slow
