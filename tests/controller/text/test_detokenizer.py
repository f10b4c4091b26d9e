"""Tests of controller.text.detokenizer: incremental text, UTF-8 hold-back and stop strings."""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

import pytest

from controller.text.detokenizer import IncrementalDetokenizer, OutputTextState, StopChecker
from controller.text.tokenizer import Tokenizer

MODEL_DIR = Path(
    os.environ.get("TANDEM_MODEL_DIR", "/root/.cache/tandem/models/SmolLM2-135M-Instruct")
).expanduser()
if not (MODEL_DIR / "tokenizer.json").is_file():
    pytest.skip(f"model directory {MODEL_DIR} not found", allow_module_level=True)

MULTIBYTE_TEXT = (
    "Hello 世界! 🎉🎉 Ünïcödé, Ελληνικά, русский, العربية, 한국어, 👩‍👩‍👧 family; "
    "math ∑∫√ and emoji 🏴‍☠️🇫🇷 — done.\n  Next line: 東京タワー 🗼"
)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_model_dir(MODEL_DIR)


def _chunks(ids: list[int], rng: random.Random, max_chunk: int = 4) -> list[list[int]]:
    out, i = [], 0
    while i < len(ids):
        k = rng.randint(1, max_chunk)
        out.append(ids[i : i + k])
        i += k
    return out


def _stream(tok: Tokenizer, chunks: list[list[int]], skip: bool = True) -> list[str]:
    det = IncrementalDetokenizer(tok, skip)
    deltas = [det.step(c) for c in chunks]
    deltas.append(det.step([], finished=True))
    return deltas


def _reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """Final text by the stop rule: the match that completes first, ties to the earliest start."""
    best = None
    for s in stops:
        i = text.find(s) if s else -1
        if i >= 0 and (best is None or (i + len(s), i) < (best[0], best[1])):
            best = (i + len(s), i, s)
    if best is None:
        return text, None
    return text[: best[0] if include else best[1]], best[2]


# ---- incremental detokenization -----------------------------------------------------------------


@pytest.mark.parametrize("skip", [True, False])
def test_random_ids_concatenate_to_decode(tok: Tokenizer, skip: bool) -> None:
    rng = random.Random(7)
    for _ in range(300):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))]
        ids += [rng.randrange(20) for _ in range(rng.randint(0, 4))]  # special tokens
        rng.shuffle(ids)
        assert "".join(_stream(tok, _chunks(ids, rng), skip)) == tok.decode(ids, skip)


def test_byte_tokens_of_multibyte_text(tok: Tokenizer) -> None:
    """Byte-level tokens that split characters: single bytes of emoji in random order too."""
    rng = random.Random(11)
    text_ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    byte_ids = [
        i
        for i in range(tok.vocab_size)
        if len(tok.decode([i])) == 1 and tok.decode([i]) == "\ufffd"
    ]
    assert byte_ids, "expected byte tokens that are partial characters"
    for _ in range(200):
        ids = list(text_ids[: rng.randint(1, len(text_ids))])
        for _ in range(rng.randint(0, 6)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(byte_ids))
        assert "".join(_stream(tok, _chunks(ids, rng))) == tok.decode(ids)


def test_multibyte_text_is_never_split(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT, add_special_tokens=False)
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids), "text should need byte tokens"
    det = IncrementalDetokenizer(tok)
    deltas = [det.step([i]) for i in ids]
    assert not any("\ufffd" in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE_TEXT == tok.decode(ids)
    assert det.token_ids == ids


def test_incomplete_character_is_released_when_finished(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🎉", add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    out = "".join(det.step([i]) for i in ids[:-1])
    assert "\ufffd" not in out
    tail = det.step([], finished=True)
    assert out + tail == tok.decode(ids[:-1]) and tail.endswith("\ufffd")


def test_first_token_text_equals_decode_of_output_ids(tok: Tokenizer) -> None:
    prompt = tok.encode_chat([{"role": "user", "content": "Say hello"}])
    output = [*tok.encode(" Hello there!", add_special_tokens=False), tok.eos_token_id]
    state = OutputTextState(tok, prompt)
    first, _ = state.update(output[:1])
    assert first == tok.decode(output[:1]) == " Hello"
    state.update(output[1:], finished=True)
    assert state.text == tok.decode(output) == " Hello there!"


def test_decode_window_is_bounded(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT * 20, add_special_tokens=False)
    det = IncrementalDetokenizer(tok)
    sizes: list[int] = []
    raw = det._decode

    def counting(window, skip_special_tokens=True):
        sizes.append(len(window))
        return raw(window, skip_special_tokens=skip_special_tokens)

    det._decode = counting
    text = "".join(det.step([i]) for i in ids)
    assert text == MULTIBYTE_TEXT * 20
    assert max(sizes) <= 16 and len(sizes) <= 1.5 * len(ids)


def _byte_fallback_tokenizer(tmp_path: Path, decoder_kind: str) -> Tokenizer:
    """A tokenizer with the word-boundary marker, `<0xNN>` byte tokens and a trimmed first space."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, normalizers

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += [
        "\u2581",
        "\u2581hello",
        "\u2581world",
        "he",
        "llo",
        "!",
        "\u2581\u4e2d",
        "\u6587",
        "a",
        "b",
        "\u2581a",
    ]
    backend = Backend(
        models.BPE({p: i for i, p in enumerate(pieces)}, [], unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    if decoder_kind == "strip":
        backend.decoder = decoders.Sequence(
            [
                decoders.Replace("\u2581", " "),
                decoders.ByteFallback(),
                decoders.Fuse(),
                decoders.Strip(" ", 1, 0),
            ]
        )
    else:
        backend.decoder = decoders.Sequence(
            [decoders.ByteFallback(), decoders.Metaspace("\u2581", prepend_scheme="always")]
        )
    backend.add_special_tokens(["<unk>", "<s>", "</s>"])
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>"})
    )
    return Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("decoder_kind", ["strip", "metaspace"])
@pytest.mark.parametrize("skip", [True, False])
def test_byte_fallback_word_marker_tokenizer(tmp_path: Path, decoder_kind: str, skip: bool) -> None:
    tok = _byte_fallback_tokenizer(tmp_path, decoder_kind)
    ids = tok.encode("hello 中文 😀 world", add_special_tokens=False)
    assert any(tok.id_to_token(i).startswith("<0x") for i in ids)
    assert tok.decode(ids) == "hello 中文 😀 world"
    rng = random.Random(5)
    specials = [0, 1, 2]
    byte_ids = [
        tok.token_to_id(f"<0x{b:02X}>") for b in (0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0x41)
    ]
    for _ in range(400):
        pool = ids + byte_ids + specials + list(range(259, tok.vocab_size))
        seq = [rng.choice(pool) for _ in range(rng.randint(1, 30))]
        deltas = _stream(tok, _chunks(seq, rng, 3), skip)
        assert "".join(deltas) == tok.decode(seq, skip)
    # The first token's word-boundary space is trimmed exactly as decode(output ids) trims it.
    state = OutputTextState(tok, [1, *tok.encode("hi", add_special_tokens=False)])
    d1, _ = state.update([tok.token_to_id("\u2581hello")])
    d2, _ = state.update([tok.token_to_id("\u2581world")], finished=True)
    assert (d1, d2) == ("hello", " world")


# ---- stop strings ------------------------------------------------------------------------------


def _feed(checker: StopChecker, pieces: list[str]) -> tuple[list[str], bool]:
    out, stopped = [], False
    for n, piece in enumerate(pieces):
        delta, stopped = checker.feed(piece, finished=n == len(pieces) - 1)
        out.append(delta)
        if stopped:
            break
    return out, stopped


@pytest.mark.parametrize(
    "text,stops,include,expected,matched",
    [
        ("Hello world. Bye", ["."], False, "Hello world", "."),
        ("Hello world. Bye", ["."], True, "Hello world.", "."),
        ("STOP right there", ["STOP"], False, "", "STOP"),  # at the very start
        ("nothing here", ["xyz", "zz"], False, "nothing here", None),  # absent
        ("abcd", ["bc", "abcd"], False, "a", "bc"),  # completes first wins
        ("abcd", ["abc", "bc"], False, "", "abc"),  # same end: the earlier start wins
        ("aaab", ["aab", "ab"], False, "a", "aab"),  # overlapping candidates
        ("xx</s", ["</s>"], False, "xx</s", None),  # prefix at the end, released when finished
        ("a\n\nb", ["\n\n"], True, "a\n\n", "\n\n"),
    ],
)
def test_stop_cases(
    text: str, stops: list[str], include: bool, expected: str, matched: str | None
) -> None:
    assert _reference_stop(text, stops, include) == (expected, matched)
    for split in ([text], list(text), [text[:2], text[2:]]):
        checker = StopChecker(stops, include)
        out, stopped = _feed(checker, split)
        assert "".join(out) == expected and stopped == (matched is not None)
        assert checker.matched_stop == matched


def test_hold_back_is_minimal() -> None:
    checker = StopChecker(["</s>", "END"])
    assert checker.feed("text <") == ("text ", False)
    assert checker.feed("/") == ("", False)
    assert checker.feed("b") == ("</b", False)  # can no longer start a stop string
    assert checker.feed(" E") == (" ", False)
    assert checker.feed("N") == ("", False)
    assert checker.feed("D tail") == ("", True)
    assert checker.feed("more", finished=True) == ("", True)


def test_stop_fuzz_stream_equals_final_and_reference() -> None:
    rng = random.Random(13)
    alphabet = "ab c"
    for _ in range(3000):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = [
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4)))
            for _ in range(rng.randint(1, 3))
        ]
        include = rng.random() < 0.3
        pieces, i = [], 0
        while i < len(text):
            k = rng.randint(0, 5)
            pieces.append(text[i : i + k])
            i += k
        pieces.append("")
        checker = StopChecker(stops, include)
        released, fed = "", ""
        for n, piece in enumerate(pieces):
            fed += piece
            delta, stopped = checker.feed(piece, finished=n == len(pieces) - 1)
            released += delta
            if stopped:
                break
            assert len(fed) - len(released) <= max(map(len, stops)) - 1  # hold back at most this
        assert (released, checker.matched_stop) == _reference_stop(text, stops, include)


def test_output_state_stop_spanning_tokens(tok: Tokenizer) -> None:
    text = "The answer is 42. Then<|fake|> more text follows here."
    ids = tok.encode(text, add_special_tokens=False)
    stop = "<|fake|>"
    spans = [
        i
        for i in range(1, len(ids))
        if stop[1:-1] in tok.decode(ids[: i + 1]) and stop not in tok.decode(ids[: i + 1])
    ]
    assert len(ids) > 10
    for stops, include in (
        ([stop], False),
        ([stop], True),
        (["42.", "answer is 4"], False),
        (["zzz"], False),
    ):
        expected, matched = _reference_stop(tok.decode(ids), stops, include)
        finals = set()
        for chunking in (1, 2, 3, len(ids)):
            state = OutputTextState(tok, None, stop=stops, include_stop_str_in_output=include)
            streamed, stopped, n = "", False, 0
            while n < len(ids) and not stopped:
                delta, stopped = state.update(
                    ids[n : n + chunking], finished=n + chunking >= len(ids)
                )
                streamed += delta
                n += chunking
            assert streamed == state.text == expected
            assert state.matched_stop == matched and state.stopped == (matched is not None)
            assert state.update([1, 2, 3], finished=True) == ("", matched is not None)
            finals.add(state.text)
        assert len(finals) == 1
    assert spans  # the stop string does span several tokens


def test_output_state_random_streams(tok: Tokenizer) -> None:
    rng = random.Random(21)
    base = tok.encode(MULTIBYTE_TEXT + " the end. the END.", add_special_tokens=False)
    for _ in range(200):
        ids = base[rng.randrange(len(base)) :]
        stops = [
            rng.choice(["世界", "🎉🎉", "the", "END", " —", "\n", ",", "zz", "🗼"])
            for _ in range(rng.randint(0, 3))
        ]
        include = rng.random() < 0.5
        expected, matched = _reference_stop(tok.decode(ids), stops, include)
        state = OutputTextState(tok, [], stop=stops, include_stop_str_in_output=include)
        streamed, stopped, chunks = "", False, _chunks(ids, rng, 3)
        for n, chunk in enumerate(chunks):
            delta, stopped = state.update(chunk, finished=n == len(chunks) - 1)
            streamed += delta
            assert expected.startswith(streamed)  # nothing released is ever taken back
            if stopped:
                break
        assert (streamed, state.matched_stop) == (expected, matched) and state.text == streamed


def test_deferred_text_equals_streamed_text(tok: Tokenizer) -> None:
    """A non-streamed request's text is decoded once at the end: nothing before, then exactly
    the streamed text; with stop strings it is not deferred (they must end it early)."""
    rng = random.Random(5)
    base = tok.encode(MULTIBYTE_TEXT + " the end. the END.", add_special_tokens=False)
    for _ in range(50):
        ids = base[rng.randrange(len(base)) :]
        chunks = _chunks(ids, rng, 3)
        streamed = OutputTextState(tok, [])
        deferred = OutputTextState(tok, [], defer=True)
        text = ""
        for n, chunk in enumerate(chunks):
            last = n == len(chunks) - 1
            text += streamed.update(chunk, finished=last)[0]
            delta, stopped = deferred.update(chunk, finished=last)
            assert not stopped and (delta == "" or last)
        assert deferred.text == text == tok.decode(ids)
        assert deferred.output_token_ids == ids
    state = OutputTextState(tok, [], stop=["END"], defer=True)
    assert state.update(tok.encode("the END", add_special_tokens=False)) == ("the ", True)


def test_output_state_with_cleanup(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers

    words = [
        "[UNK]",
        "[CLS]",
        "hello",
        "world",
        ".",
        "don",
        "'",
        "t",
        "s",
        "!",
        ",",
        "?",
        "n",
        "re",
        "ve",
        "m",
        " ",
    ]
    backend = Backend(models.WordPiece({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    backend.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"clean_up_tokenization_spaces": True})
    )
    tok = Tokenizer.from_model_dir(tmp_path)
    assert tok.clean_up_tokenization_spaces
    rng = random.Random(2)
    for _ in range(500):
        ids = [rng.randrange(len(words)) for _ in range(rng.randint(1, 15))]
        state = OutputTextState(tok, None, stop=["?"] if rng.random() < 0.3 else None)
        streamed = ""
        for n, chunk in enumerate(chunks := _chunks(ids, rng, 3)):
            streamed += state.update(chunk, finished=n == len(chunks) - 1)[0]
        assert (
            streamed
            == state.text
            == _reference_stop(tok.decode(ids), ["?"] if state.stopped else [], False)[0]
        )


def test_update_is_fast(tok: Tokenizer) -> None:
    ids = tok.encode(MULTIBYTE_TEXT * 30, add_special_tokens=False)
    state = OutputTextState(tok, None, stop=["never appears", "nor this", "<|x|>"])
    started = time.perf_counter()
    for i in ids:
        state.update([i])
    per_token = (time.perf_counter() - started) / len(ids)
    state.update([], finished=True)
    assert state.text == MULTIBYTE_TEXT * 30
    assert per_token < 100e-6, f"{per_token * 1e6:.1f} us per token"
