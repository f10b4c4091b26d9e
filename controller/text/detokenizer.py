"""Incremental detokenization and stop strings, per request, for streaming and final text.

Per generated token the controller turns the new ids into a text delta, removes any stop string
(OpenAI semantics: the stop string itself is not returned) and streams only text that can no
longer turn out to be part of a stop string. The invariants the tests hold:

- the concatenation of all deltas equals `tokenizer.decode(output_ids)` (no stop strings), and no
  delta ends in half a multi-byte character;
- with stop strings, the streamed deltas add up to exactly the final (non-streamed) text;
- the work per step is bounded by the step's tokens and the longest stop string, not by the
  length of the output so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

from controller.text.byte_level import ByteLevelDetokenizer, byte_level_table
from controller.text.stream_detokenizer import StreamDetokenizer, stream_decoding_fits
from controller.text.tokenizer import Tokenizer, clean_up_tokenization

# Decoded text ending in this character may be an incomplete multi-byte character.
_REPLACEMENT_CHAR = "\ufffd"
# When the decode window grows beyond this many tokens it slides forward.
_MAX_WINDOW_TOKENS = 8


@lru_cache(maxsize=16)
def byte_fallback_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids of the `<0xNN>` byte tokens when the model's decoder merges runs of them into text.
    Cached per tokenizer: every request's detokenizer asks, and the answer is the decoder's."""
    decoder = tokenizer.backend.decoder
    description = decoder.__getstate__() if decoder is not None else b""  # its JSON
    if b"ByteFallback" not in description:
        return frozenset()
    ids = (tokenizer.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


class IncrementalDetokenizer:
    """Turns a growing sequence of output token ids into text deltas.

    Each step decodes only a short window of recent tokens: `_prefix` marks where the window
    starts and `_read` where the text already returned ends (both always on character
    boundaries), and the delta is the window's text minus the text of its first `_read -
    _prefix` tokens. Text that ends in an incomplete character is held until it completes (or
    the request finishes). The output text is `decode(output_ids)`: the window starts at the first
    output token, not in the prompt, so a first token's leading space is kept or dropped exactly
    as decoding the output ids alone does.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._decode = tokenizer.backend.decode  # raw decode; cleanup is a separate stage
        self._skip_special_tokens = skip_special_tokens  # drop special tokens from the text
        self._ids: list[int] = []  # every output token id so far
        self._prefix = 0  # first token of the decode window
        self._read = 0  # tokens whose text has been returned
        self._last_read = 0  # `_read` before the latest advance: a safe new window start
        self._prefix_text = ""  # decode of ids[_prefix:_read], standalone
        self._byte_ids = byte_fallback_ids(tokenizer)  # `<0xNN>` ids, if runs of them merge
        # Special tokens that decoding drops, and so do not end a run of byte tokens.
        self._invisible = tokenizer.skipped_special_ids if skip_special_tokens else frozenset()
        self._in_byte_run = False  # the last visible token is a byte token (its run may go on)

    @property
    def token_ids(self) -> list[int]:
        """The output token ids seen so far."""
        return self._ids

    def seed(self, ids: Sequence[int]) -> None:
        """Start from output ids whose text has all been returned already (by another
        detokenizer): the window spans them all once, then slides as usual."""
        self._ids = list(ids)
        self._prefix, self._read = 0, len(self._ids)
        self._last_read = self._read
        self._prefix_text = self._decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        for token_id in self._ids:
            if token_id in self._byte_ids:
                self._in_byte_run = True
            elif token_id not in self._invisible:
                self._in_byte_run = False

    def step(self, new_token_ids: Sequence[int], finished: bool = False) -> str:
        """Append new ids and return the text they complete; `finished` flushes held text."""
        ids = self._ids
        ids.extend(new_token_ids)
        if self._byte_ids:
            for token_id in new_token_ids:
                if token_id in self._byte_ids:
                    self._in_byte_run = True
                elif token_id not in self._invisible:
                    self._in_byte_run = False
            # A run of byte tokens decodes as a whole: wait until it ends.
            if self._in_byte_run and not finished:
                return ""
        if len(ids) == self._read:
            return ""
        text = self._decode(ids[self._prefix :], skip_special_tokens=self._skip_special_tokens)
        if not finished and text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = text[len(self._prefix_text) :]
        self._last_read, self._read = self._read, len(ids)
        self._prefix_text = text
        if self._read - self._prefix > _MAX_WINDOW_TOKENS:
            self._slide()
        return delta

    def _slide(self) -> None:
        """Move the window start to the previous read offset, if the tokens from there decode to
        something (so the window keeps a visible first token, whose text some decoders trim)."""
        start = self._last_read
        if start <= self._prefix:
            return
        text = self._decode(
            self._ids[start : self._read], skip_special_tokens=self._skip_special_tokens
        )
        if text:
            self._prefix, self._prefix_text = start, text


def prepare_detokenizers(tokenizer: Tokenizer) -> None:
    """Build a tokenizer's cached detokenizer tables now (at startup), so that the first
    request does not wait for them."""
    for skip in (True, False):
        byte_level_table(tokenizer, skip)
    byte_fallback_ids(tokenizer)


def make_detokenizer(
    tokenizer: Tokenizer, skip_special_tokens: bool = True
) -> IncrementalDetokenizer | StreamDetokenizer | ByteLevelDetokenizer:
    """One request's detokenizer, each returning the same deltas: table look-ups for a
    byte-level BPE tokenizer (controller/text/byte_level.py), else the Rust stream
    (controller/text/stream_detokenizer.py) where no byte-token runs merge, else this module's
    Python window."""
    table = byte_level_table(tokenizer, skip_special_tokens)
    if table is not None:
        return ByteLevelDetokenizer(table)
    if stream_decoding_fits(byte_fallback_ids(tokenizer)):
        return StreamDetokenizer(tokenizer, skip_special_tokens, IncrementalDetokenizer)
    return IncrementalDetokenizer(tokenizer, skip_special_tokens)


class _SpaceCleanupStream:
    """Applies `clean_up_tokenization` to streamed text exactly as to the whole text.

    Every cleanup pattern starts with a space and is at most 4 characters long, so the text can be
    cut wherever the 3 characters before the cut hold no space: no pattern can span such a cut.
    The tail after the last such cut waits for more text.
    """

    def __init__(self) -> None:
        self._pending = ""  # text not yet cleaned and returned

    def feed(self, text: str, finished: bool) -> str:
        """Cleaned text that can be released now."""
        buf = self._pending + text
        cut = len(buf)
        if not finished:
            while cut > 0 and " " in buf[max(0, cut - 3) : cut]:
                cut = buf.rfind(" ", max(0, cut - 3), cut)
        self._pending = buf[cut:]
        return clean_up_tokenization(buf[:cut])


@lru_cache(maxsize=256)
def _failure(stop: str) -> tuple[int, ...]:
    """KMP failure table of a stop string: entry k is the length of the longest proper border
    (prefix that is also a suffix) of ``stop[: k + 1]``. Cached: the choices of one request,
    and requests that repeat a stop string, share one table; 256 tables of at most the longest
    allowed stop string bound what the cache holds."""
    table = [0] * len(stop)
    k = 0
    for i in range(1, len(stop)):
        while k and stop[i] != stop[k]:
            k = table[k - 1]
        if stop[i] == stop[k]:
            k += 1
        table[i] = k
    return tuple(table)


def _advance(stop: str, table: tuple[int, ...], k: int, text: str) -> tuple[int, int]:
    """Run the KMP automaton of ``stop`` from state ``k`` (the length of the longest suffix of
    the text so far that is a prefix of ``stop``) over ``text``. Returns (new state, -1), or
    (len(stop), end) when ``stop`` first completes just before ``text[end]``. While the state
    is 0 the scan jumps to the next occurrence of the first character (``str.find``, in C)."""
    first, full, i, n = stop[0], len(stop), 0, len(text)
    while i < n:
        if k == 0:
            i = text.find(first, i)
            if i < 0:
                return 0, -1
            k, i = 1, i + 1
        else:
            c = text[i]
            while k and stop[k] != c:
                k = table[k - 1]
            if stop[k] == c:
                k += 1
            i += 1
        if k == full:
            return k, i
    return k, -1


class StopChecker:
    """Finds stop strings in streamed text and holds back what could still begin one.

    A stop string may span deltas. The match chosen is the one that completes first (ties: the
    one that starts first), which is what checking after every single character would find, so
    the result does not depend on how the text was split into deltas. Only text that is not the
    start of a possible stop string is released.

    Each stop string runs a KMP automaton over the text as it arrives; its state is the length
    of the longest suffix of the text that is a prefix of that stop string, so the text held
    back is the longest of those suffixes. Memory is linear in the stop strings' length (one
    failure table each, shared through a cache) and the work per delta is linear in the delta
    (amortized) per stop string: no set of every prefix, no rescan of held text.
    """

    def __init__(
        self, stop: Sequence[str] | None = None, include_stop_str_in_output: bool = False
    ) -> None:
        self.stop: tuple[str, ...] = tuple(
            dict.fromkeys(s for s in (stop or ()) if s)
        )  # stop strings
        self.include_stop_str_in_output = include_stop_str_in_output  # keep the matched stop string
        self.matched_stop: str | None = None  # the stop string that ended the text, if any
        self._tables = [_failure(s) for s in self.stop]  # KMP failure table per stop string
        self._states = [0] * len(self.stop)  # per stop string: its prefix the text ends with
        self._pending = ""  # held text: a suffix that could begin a stop string

    @property
    def stopped(self) -> bool:
        """Whether a stop string has been found."""
        return self.matched_stop is not None

    def feed(self, delta: str, finished: bool = False) -> tuple[str, bool]:
        """Take new text; return (text to release, whether a stop string matched).

        When `finished`, everything still held is released. After a match, the released text
        ends just before the stop string (or just after it, when it is included).
        """
        if self.matched_stop is not None:
            return "", True
        if not self.stop:
            return delta, False
        if not delta and not finished:
            return "", False
        region = self._pending + delta
        offset = len(self._pending)  # where delta starts in region
        best_end = best_start = -1
        best = ""
        for i, s in enumerate(self.stop):
            state, end = _advance(s, self._tables[i], self._states[i], delta)
            self._states[i] = state
            if end >= 0:
                end += offset
                start = end - len(s)
                if best_end < 0 or end < best_end or (end == best_end and start < best_start):
                    best_end, best_start, best = end, start, s
        if best_end >= 0:
            self.matched_stop = best
            self._pending = ""
            return region[: best_end if self.include_stop_str_in_output else best_start], True
        hold = 0 if finished else max(self._states)
        self._pending = region[len(region) - hold :]
        return region[: len(region) - hold], False


class OutputTextState:
    """The text of one request's output: detokenization, stop strings and streaming hold-back.

    `update` is called once per step with the step's new token ids and returns the text delta to
    stream and whether a stop string matched (the engine then finishes the request). With
    `defer` (a non-streamed request) and no stop strings, all the text comes with the last call.
    `text` is always the concatenation of the deltas returned so far; it is final once `update`
    has been called with `finished=True` or has reported a stop.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_ids: Sequence[int] | None = None,
        stop: Sequence[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        defer: bool = False,
    ) -> None:
        # `prompt_ids` is accepted for callers' convenience but not needed: the output text is
        # defined as decode(output ids), which no prompt context may change.
        del prompt_ids
        # Nobody reads the text before the end and no stop string can end it early: decode once,
        # when the request finishes, instead of a window per step (the same text, by the
        # incremental decoder's contract).
        self._defer = defer and not any(stop or ())
        self._deferred_ids: list[int] = []  # ids held back while deferring
        self._detokenizer = make_detokenizer(tokenizer, skip_special_tokens)  # ids -> text
        # Cleanup of spaces before punctuation, for the (word-piece) models that ask for it.
        self._cleanup = _SpaceCleanupStream() if tokenizer.clean_up_tokenization_spaces else None
        self._stops = StopChecker(stop, include_stop_str_in_output)  # stop strings, hold-back
        self._pieces: list[str] = []  # deltas returned so far
        self.finished = False  # `update(..., finished=True)` has been called, or a stop matched

    @property
    def deferred(self) -> bool:
        """Whether the text is decoded only at the end (nothing reads it before)."""
        return self._defer

    @property
    def stopped(self) -> bool:
        """Whether a stop string ended the output."""
        return self._stops.stopped

    @property
    def matched_stop(self) -> str | None:
        """The stop string that ended the output, if any."""
        return self._stops.matched_stop

    @property
    def output_token_ids(self) -> list[int]:
        """The output token ids given so far."""
        return self._detokenizer.token_ids + self._deferred_ids

    @property
    def text(self) -> str:
        """The output text so far: the concatenation of every delta returned."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def update(self, new_token_ids: Sequence[int], finished: bool = False) -> tuple[str, bool]:
        """Take a step's new token ids; return (delta_text, stopped).

        `finished` means the request ends for another reason (length, EOS, abort): any held text
        is released. Once a stop string has matched, further calls return ("", True).
        """
        if self.finished:
            return "", self.stopped
        if self._defer:
            self._deferred_ids.extend(new_token_ids)
            if not finished:
                return "", False
            new_token_ids, self._deferred_ids = self._deferred_ids, []
        delta = self._detokenizer.step(new_token_ids, finished)
        if self._cleanup is not None:
            delta = self._cleanup.feed(delta, finished)
        out, stopped = self._stops.feed(delta, finished)
        if out:
            self._pieces.append(out)
        self.finished = finished or stopped
        return out, stopped
