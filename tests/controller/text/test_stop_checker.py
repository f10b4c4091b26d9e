"""Stop strings in linear memory: the KMP matcher against the reference rule, on long and
self-overlapping stop strings, with its memory and time per delta bounded."""

from __future__ import annotations

import random
import time
import tracemalloc

from controller.text.detokenizer import StopChecker
from tests.controller.text.test_detokenizer import _reference_stop


def _stream(checker: StopChecker, pieces: list[str]) -> tuple[str, int]:
    """Released text, and the most text held back at once."""
    released, fed, held = "", "", 0
    for n, piece in enumerate(pieces):
        fed += piece
        delta, stopped = checker.feed(piece, finished=n == len(pieces) - 1)
        released += delta
        if stopped:
            break
        held = max(held, len(fed) - len(released))
    return released, held


def _pieces(text: str, rng: random.Random, most: int) -> list[str]:
    pieces, i = [], 0
    while i < len(text):
        k = rng.randint(0, most)
        pieces.append(text[i : i + k])
        i += k
    return [*pieces, ""]


def test_self_overlapping_stops_match_the_reference() -> None:
    """Stop strings with long borders (where a naive matcher restarts wrongly) on text built
    from their own pieces, split at random."""
    rng = random.Random(7)
    for _ in range(2000):
        unit = "".join(rng.choice("ab") for _ in range(rng.randint(1, 3)))
        stops = [unit * rng.randint(1, 4) + rng.choice(["", "a", "b", "c"]) for _ in range(2)]
        text = "".join(rng.choice([unit, "a", "b", "c"]) for _ in range(rng.randint(0, 20)))
        include = rng.random() < 0.3
        checker = StopChecker(stops, include)
        released, held = _stream(checker, _pieces(text, rng, 6))
        assert (released, checker.matched_stop) == _reference_stop(text, stops, include)
        assert held <= max(map(len, stops)) - 1


def test_hold_is_the_longest_suffix_that_begins_a_stop() -> None:
    checker = StopChecker(["abcabd", "zz"])
    assert checker.feed("xxabcab") == ("xx", False)  # "abcab" may still become "abcabd"
    assert checker.feed("c") == ("abc", False)  # "abcabc": only its suffix "abc" may
    assert checker.feed("abd and more") == ("", True)
    assert checker.matched_stop == "abcabd"


def test_a_long_stop_string_costs_linear_memory_and_time() -> None:
    """A 40,000-character stop string: the checker holds a few hundred KiB (the old set of
    every prefix held about 800 MB), and a long text streams in linear time."""
    stop = "x" * 39_999 + "y"
    tracemalloc.start()
    checker = StopChecker([stop])
    checker.feed("x" * 100)
    current, _ = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert current < 2 * 2**20, current  # the failure table (one small int per character)
    text = "x" * 60_000
    started = time.perf_counter()
    released, held = _stream(checker, [text[i : i + 7] for i in range(0, len(text), 7)])
    elapsed = time.perf_counter() - started
    assert held == len(stop) - 1 - 100  # 100 more were held before the stream
    assert released == "x" * 60_100  # no match: all of it, when finished
    assert elapsed < 5.0, elapsed  # linear: the quadratic hold-back search took minutes
    again = StopChecker([stop])
    assert again.feed("x" * 39_999 + "yz") == ("", True)


def test_many_stop_strings_per_delta_cost() -> None:
    """Sixteen stop strings of 1,024 characters: a delta costs microseconds, not a scan of
    every stop string's prefixes."""
    rng = random.Random(3)
    stops = ["".join(rng.choice("abcdef") for _ in range(1024)) for _ in range(16)]
    checker = StopChecker(stops)
    text = "".join(rng.choice("abcdefgh ") for _ in range(20_000))
    pieces = [text[i : i + 4] for i in range(0, len(text), 4)]
    started = time.perf_counter()
    released, _ = _stream(checker, pieces)
    per_delta = (time.perf_counter() - started) / len(pieces)
    assert (released, checker.matched_stop) == _reference_stop(text, stops, False)
    assert per_delta < 500e-6, f"{per_delta * 1e6:.0f} us per delta"
