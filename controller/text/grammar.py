"""Structured-output grammars, owned by the controller: compile a request's constraint once,
then follow its output token by token and say which tokens may come next.

The engine is llguidance (chosen by benchmarks/grammar_engines.py; benchmarks/README.md has
the numbers): it imports no torch, compiles a realistic JSON schema in about a millisecond,
and takes its vocabulary straight from the model's tokenizer.json. Compiling is the cheap
part; the expensive part is the lexer that a matcher builds lazily while computing masks. So
a compiled grammar keeps one *template* matcher whose first mask has been computed, and every
request's matcher is a deep copy of it (~10 us, and it inherits the warmed lexer).

Compiled grammars live in an LRU cache keyed by the constraint (kind and canonical text),
bounded in entries and in estimated bytes. A request's matcher can be rebuilt after a
failover or preemption by replaying the output tokens the controller already holds
(`CompiledGrammar.replay`), or copied as is (`GrammarMatcher.copy`).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import llguidance
import numpy as np

# Constraint kinds: vLLM's structured_outputs names, OpenAI's response_format types.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")
# JSON compile options: compact JSON (no free whitespace: small models otherwise loop on it).
_JSON_DEFAULTS: dict[str, Any] = {"whitespace_flexible": False}
# Estimated bytes a cached grammar holds: its text (the parsed grammar and warmed lexer scale
# with it) plus a fixed part for the template matcher's lexer and parser tables.
_BYTES_PER_GRAMMAR_CHAR = 16
_BYTES_PER_ENTRY = 256 << 10


class GrammarError(ValueError):
    """The engine refused a constraint (invalid or unsatisfiable); the message says why."""


class GrammarTooLarge(GrammarError):
    """A constraint's text is longer than the limit; refused before compiling."""


@dataclass(frozen=True)
class Constraint:
    """What a request asked its output to match, in a canonical form (the cache key)."""

    kind: str  # one of KINDS
    # A JSON schema (compact JSON), a regex, a JSON list of choices, a Lark or GBNF
    # grammar; "" for json_object (any JSON object).
    spec: str


@dataclass(frozen=True)
class GrammarLimits:
    """Bounds on compiling and caching grammars (settings of the "request limits" group)."""

    max_chars: int = 64 << 10  # longest constraint text (schema, regex, grammar, choices)
    cache_entries: int = 256  # most compiled grammars kept
    cache_bytes: int = 64 << 20  # most estimated bytes of compiled grammars kept


@dataclass
class CacheStats:
    """What the compiled-grammar cache did."""

    hits: int = 0  # compiles answered from the cache
    misses: int = 0  # compiles that ran the engine (refusals included)
    evictions: int = 0  # entries dropped for the bounds
    entries: int = 0  # entries held now
    bytes: int = 0  # estimated bytes held now


def _first_line(message: str) -> str:
    """The reason in an engine message: its first line and a regex parser's `error:` line
    (the rest dumps parser state)."""
    lines = message.strip().splitlines() or [""]
    detail = [x.strip() for x in lines[1:] if x.strip().startswith("error:")][:1]
    return " ".join([lines[0].strip(), *detail])[:500]


def json_schema_constraint(schema: dict[str, Any] | bool) -> Constraint:
    """A JSON-schema constraint (the schema as compact JSON; keys keep their order, which is
    the order the output's properties take)."""
    return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))


def choice_constraint(choices: list[str]) -> Constraint:
    """Output exactly one of `choices`."""
    return Constraint("choice", json.dumps(list(choices), ensure_ascii=False))


def _grammar_text(c: Constraint) -> str:
    """llguidance's grammar for a constraint; GrammarError when it cannot be made."""
    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=_JSON_DEFAULTS)
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                '{"type":"object"}', defaults=_JSON_DEFAULTS
            )
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "choice":
            choices = json.loads(c.spec)
            if not choices:
                raise GrammarError("choice: the list is empty")
            alternatives = " | ".join(json.dumps(x, ensure_ascii=False) for x in choices)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}")
        if c.kind == "grammar":
            return llguidance.grammar_from("grammar", c.spec)
    except GrammarError:
        raise
    except Exception as exc:  # the engine's own words: a bad schema, regex or grammar
        raise GrammarError(_first_line(str(exc))) from exc
    raise GrammarError(f"unknown constraint kind {c.kind!r}")


class GrammarMatcher:
    """One request's position in its grammar: which tokens may come next, and the tokens it
    took so far. Not thread-safe: one request's matcher is driven by one task at a time."""

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, accepted: int = 0):
        self._m = matcher  # the engine's matcher
        self.vocab_size = vocab_size  # tokens the mask covers
        self.num_accepted = accepted  # tokens accepted so far (the output's length)

    @property
    def mask_words(self) -> int:
        """uint32 words of a mask: ceil(vocab / 32)."""
        return (self.vocab_size + 31) // 32

    def allowed_mask(self) -> bytes:
        """The tokens allowed next, as packed bits: little-endian uint32 words, bit t % 32 of
        word t // 32 set when token t is allowed (the form a step will carry)."""
        # The engine's mask may cover a few padding ids past the vocabulary: cut to it.
        return self._m.compute_bitmask()[: self.mask_words * 4]

    def allowed_tokens(self) -> list[int]:
        """The allowed token ids (for tests and debugging: O(vocabulary))."""
        bits = np.unpackbits(np.frombuffer(self.allowed_mask(), np.uint8), bitorder="little")
        return np.flatnonzero(bits[: self.vocab_size]).tolist()

    def accept(self, token_id: int) -> bool:
        """Take one sampled token; False (and the matcher failed) when the grammar refused it."""
        ok = self._m.consume_token(token_id)
        self.num_accepted += ok
        return ok

    def accept_all(self, token_ids: list[int]) -> bool:
        """Take several tokens at once (a replay); False when one was refused."""
        ok = self._m.consume_tokens(token_ids)
        if ok:
            self.num_accepted += len(token_ids)
        return ok

    def can_end(self) -> bool:
        """The output so far is complete: ending here (EOS) matches the grammar."""
        return self._m.is_accepting()

    def is_finished(self) -> bool:
        """No further token is possible: the grammar is complete or the matcher failed."""
        return self._m.is_stopped()

    @property
    def failed(self) -> bool:
        """The grammar can no longer be satisfied (a refused token, or a resource limit)."""
        return self._m.is_error()

    @property
    def error(self) -> str:
        """Why the matcher failed ("" when it did not)."""
        return _first_line(self._m.get_error()) if self._m.is_error() else ""

    def rollback(self, num_tokens: int) -> bool:
        """Forget the last `num_tokens` accepted tokens (speculation, pipelining)."""
        if num_tokens > self.num_accepted:
            return False
        ok = self._m.rollback(num_tokens)
        if ok:
            self.num_accepted -= num_tokens
        return ok

    def copy(self) -> GrammarMatcher:
        """An independent matcher in the same state (a preempted or moved request's)."""
        return GrammarMatcher(self._m.deep_copy(), self.vocab_size, self.num_accepted)


@dataclass
class CompiledGrammar:
    """A constraint compiled once; requests take matchers from it."""

    constraint: Constraint  # what was compiled
    grammar: str  # llguidance's grammar text
    compile_s: float  # seconds compiling and warming took
    cost_bytes: int  # estimated bytes held in the cache
    vocab_size: int  # tokens a mask covers
    _template: llguidance.LLMatcher = field(repr=False)  # warmed, never advanced

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the start of the output."""
        return GrammarMatcher(self._template.deep_copy(), self.vocab_size)

    def replay(self, output_token_ids: list[int]) -> GrammarMatcher:
        """A matcher that has taken `output_token_ids` (a request resumed elsewhere); its
        `failed` says whether they matched."""
        m = self.matcher()
        if output_token_ids:
            m.accept_all(list(output_token_ids))
        return m


class GrammarCompiler:
    """Compiles constraints for one tokenizer, with an LRU cache of compiled grammars.

    Thread-safe: the API compiles on worker threads, off the event loop. The engine's
    tokenizer is built on first use (it takes about a second for a 150k vocabulary)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: list[int],
        limits: GrammarLimits | None = None,
    ):
        self.limits = limits or GrammarLimits()  # size and cache bounds
        self.vocab_size = vocab_size  # the model's vocabulary (mask width)
        self._tokenizer_json = tokenizer_json  # the model's tokenizer.json text
        self._eos = list(eos_token_ids)  # ids that end the output once the grammar allows
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._lock = threading.Lock()  # guards the cache (held for dictionary work only)
        # Guards the lazy tokenizer apart: building it takes up to seconds, and the event
        # loop's cache lookups must not wait for that.
        self._tokenizer_lock = threading.Lock()
        self._cache: OrderedDict[Constraint, CompiledGrammar] = OrderedDict()
        self.stats = CacheStats()  # hits, misses, evictions, what is held

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, limits: GrammarLimits | None = None):
        """A compiler over the controller's Tokenizer (its `tokenizers` backend); None when
        the tokenizer has no such backend (a test's fake)."""
        backend = getattr(tokenizer, "backend", None)
        if backend is None or not hasattr(backend, "to_str"):
            return None
        eos = list(getattr(tokenizer, "eos_token_ids", []) or [])
        return cls(backend.to_str(), tokenizer.vocab_size, eos, limits)

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = llguidance.LLTokenizer(
                    self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self._eos or None
                )
            return self._tokenizer

    def check_size(self, c: Constraint) -> None:
        """GrammarTooLarge when the constraint's text is over the limit."""
        if len(c.spec) > self.limits.max_chars:
            raise GrammarTooLarge(
                f"the {c.kind} has {len(c.spec)} characters; at most "
                f"{self.limits.max_chars} are allowed"
            )

    def cached(self, c: Constraint) -> CompiledGrammar | None:
        """The compiled grammar of `c` if the cache holds it (counts a hit)."""
        with self._lock:
            hit = self._cache.get(c)
            if hit is not None:
                self._cache.move_to_end(c)
                self.stats.hits += 1
            return hit

    def compile(self, c: Constraint) -> CompiledGrammar:
        """The compiled grammar of `c`, from the cache or the engine; GrammarError when the
        engine refuses it (the reason in the message)."""
        self.check_size(c)
        hit = self.cached(c)
        if hit is not None:
            return hit
        with self._lock:
            self.stats.misses += 1
        compiled = self._build(c)
        self._insert(compiled)
        return compiled

    def _build(self, c: Constraint) -> CompiledGrammar:
        start = time.perf_counter()
        tok = self._llg_tokenizer()
        text = _grammar_text(c)
        problem = llguidance.LLMatcher.validate_grammar(text, tok)
        if problem and not problem.startswith("WARNING"):
            raise GrammarError(_first_line(problem))
        template = llguidance.LLMatcher(tok, text, log_level=0)
        template.compute_bitmask()  # warms the lexer every copy inherits
        if template.is_error():
            raise GrammarError(_first_line(template.get_error()))
        cost = _BYTES_PER_ENTRY + _BYTES_PER_GRAMMAR_CHAR * len(text)
        elapsed = time.perf_counter() - start
        return CompiledGrammar(c, text, elapsed, cost, self.vocab_size, template)

    def _insert(self, compiled: CompiledGrammar) -> None:
        """Keep `compiled`, evicting the least recently used beyond the bounds; a grammar
        larger than the whole byte bound is used but not kept."""
        if compiled.cost_bytes > self.limits.cache_bytes or self.limits.cache_entries < 1:
            return
        with self._lock:
            old = self._cache.pop(compiled.constraint, None)
            if old is not None:
                self.stats.bytes -= old.cost_bytes
            self._cache[compiled.constraint] = compiled
            self.stats.bytes += compiled.cost_bytes
            while (
                len(self._cache) > self.limits.cache_entries
                or self.stats.bytes > self.limits.cache_bytes
            ):
                _, dropped = self._cache.popitem(last=False)
                self.stats.bytes -= dropped.cost_bytes
                self.stats.evictions += 1
            self.stats.entries = len(self._cache)
