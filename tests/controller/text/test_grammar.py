"""The controller's grammars over the default model's tokenizer: exact masks for small cases,
walks through the mask that end in valid output, refused and unsatisfiable constraints,
replay, copy and rollback, and the compiled-grammar cache's bounds."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys

import jsonschema
import numpy as np
import pytest

from controller.text.grammar import (
    Constraint,
    GrammarCompiler,
    GrammarError,
    GrammarLimits,
    GrammarTooLarge,
    choice_constraint,
    json_schema_constraint,
)
from controller.text.tokenizer import Tokenizer

SCHEMAS = [
    {  # nested objects, enums, bounded numbers, required fields
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "tier": {"enum": ["free", "pro", "enterprise"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 120},
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "tier", "age", "address"],
        "additionalProperties": False,
    },
    {  # arrays of bounded numbers
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "number", "minimum": -1.5, "maximum": 2.5},
                "minItems": 2,
                "maxItems": 4,
            },
            "ok": {"type": "boolean"},
        },
        "required": ["scores", "ok"],
        "additionalProperties": False,
    },
    {"type": "array", "items": {"enum": ["red", "green", 3, None]}, "minItems": 1, "maxItems": 3},
]


@pytest.fixture(scope="module")
def tok(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


@pytest.fixture(scope="module")
def compiler(tok) -> GrammarCompiler:
    return GrammarCompiler.for_tokenizer(tok)


@pytest.fixture(scope="module")
def texts(tok) -> list[str]:
    """Each token's text alone (special tokens included)."""
    return [tok.decode([t], skip_special_tokens=False) for t in range(tok.vocab_size)]


def test_mask_is_packed_little_endian_words(compiler):
    m = compiler.compile(Constraint("regex", "7")).matcher()
    mask = m.allowed_mask()
    assert len(mask) == 4 * m.mask_words == 4 * ((compiler.vocab_size + 31) // 32)
    words = np.frombuffer(mask, "<u4")
    allowed = [t for t in range(compiler.vocab_size) if words[t // 32] >> (t % 32) & 1]
    assert allowed == m.allowed_tokens()


def test_choice_mask_is_exactly_the_prefixes(compiler, tok, texts):
    m = compiler.compile(choice_constraint(["yes", "no"])).matcher()
    expected = [t for t, s in enumerate(texts) if s and ("yes".startswith(s) or "no".startswith(s))]
    assert m.allowed_tokens() == expected
    assert not m.can_end()
    assert m.accept(tok.encode("yes", add_special_tokens=False)[0])
    # Once a choice is complete, only the end of the output may follow.
    if m.can_end():
        assert set(m.allowed_tokens()) == set(tok.eos_token_ids)


def test_regex_mask_is_exactly_the_digit_runs(compiler, texts):
    m = compiler.compile(Constraint("regex", "[0-9]{2}")).matcher()
    expected = [t for t, s in enumerate(texts) if s.isascii() and s.isdigit() and len(s) <= 2]
    assert m.allowed_tokens() == expected


def _walk(matcher, tok, rng: random.Random, texts, limit: int = 400) -> list[int]:
    """A sampler's path through the mask: EOS when allowed, else often a closing character,
    else any allowed token (a model's choices, within the grammar)."""
    out: list[int] = []
    eos = set(tok.eos_token_ids)
    for _ in range(limit):
        allowed = matcher.allowed_tokens()
        assert allowed, "the mask allows nothing"
        if eos & set(allowed):
            return out
        closing = [t for t in allowed if texts[t] and texts[t][-1] in '"]},']
        pool = closing if closing and rng.random() < 0.6 else allowed
        t = rng.choice(pool)
        assert matcher.accept(t), matcher.error
        out.append(t)
    raise AssertionError("the walk did not end")


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_walks_through_the_mask_give_schema_valid_json(compiler, tok, texts, index):
    schema = SCHEMAS[index]
    compiled = compiler.compile(json_schema_constraint(schema))
    for seed in range(3):
        m = compiled.matcher()
        ids = _walk(m, tok, random.Random(seed), texts)
        assert m.can_end()
        jsonschema.validate(json.loads(tok.decode(ids)), schema)


def test_json_object_gives_an_object(compiler, tok, texts):
    m = compiler.compile(Constraint("json_object", "")).matcher()
    value = json.loads(tok.decode(_walk(m, tok, random.Random(1), texts)))
    assert isinstance(value, dict)


@pytest.mark.parametrize(
    "regex", [r"[A-Z][a-z]{2,6} [0-9]{4}-[0-9]{2}", r"(ok|fail|retry)!?", r"-?[0-9]+\.[0-9]{1,2}"]
)
def test_regex_walks_fully_match(compiler, tok, texts, regex):
    compiled = compiler.compile(Constraint("regex", regex))
    for seed in range(3):
        m = compiled.matcher()
        assert re.fullmatch(regex, tok.decode(_walk(m, tok, random.Random(seed), texts)))


def test_choice_walks_end_in_the_set(compiler, tok, texts):
    choices = ["red", "green", "blue sky", "é"]
    compiled = compiler.compile(choice_constraint(choices))
    for seed in range(6):
        m = compiled.matcher()
        assert tok.decode(_walk(m, tok, random.Random(seed), texts)) in choices


def test_grammar_kind_takes_lark_and_gbnf(compiler, tok, texts):
    for text in ('start: "a" | "b" "c"', 'root ::= "a" | "b" "c"'):
        m = compiler.compile(Constraint("grammar", text)).matcher()
        assert tok.decode(_walk(m, tok, random.Random(0), texts)) in ("a", "bc")


@pytest.mark.parametrize(
    "constraint,reason",
    [
        (Constraint("json_schema", '{"type": "foo"}'), "foo"),
        (json_schema_constraint({"type": "string", "minLength": 5, "maxLength": 2}), "nsatisf"),
        (json_schema_constraint({"$ref": "#/nope"}), "nope"),
        (Constraint("regex", "(["), "unclosed"),
        (Constraint("regex", "a{3,1}"), "repetition"),
        (Constraint("grammar", "start: foo"), "foo"),
        (Constraint("grammar", "root ::= foo"), "foo"),
        (choice_constraint([]), "empty"),
    ],
)
def test_refused_constraints_say_why(compiler, constraint, reason):
    with pytest.raises(GrammarError) as exc:
        compiler.compile(constraint)
    assert reason in str(exc.value) and "\n" not in str(exc.value)


def test_a_refused_token_fails_the_matcher(compiler, tok):
    m = compiler.compile(choice_constraint(["yes"])).matcher()
    assert not m.accept(tok.encode("no", add_special_tokens=False)[0])
    assert m.failed and m.error and m.is_finished() and not m.can_end()
    assert m.num_accepted == 0


def test_replay_copy_and_rollback(compiler, tok):
    compiled = compiler.compile(json_schema_constraint(SCHEMAS[1]))
    ids = tok.encode('{"scores":[0.5,2],"ok":true}', add_special_tokens=False)
    walked = compiled.matcher()
    masks = []
    for t in ids:
        masks.append(walked.allowed_mask())
        assert walked.accept(t), walked.error
    assert walked.can_end() and walked.num_accepted == len(ids)
    half = len(ids) // 2
    resumed = compiled.replay(ids[:half])  # a request moved mid-output
    assert not resumed.failed and resumed.num_accepted == half
    assert resumed.allowed_mask() == masks[half]
    twin = resumed.copy()
    assert twin.accept(ids[half]) and twin.num_accepted == half + 1
    assert resumed.allowed_mask() == masks[half]  # the copy is independent
    assert twin.rollback(1) and twin.allowed_mask() == masks[half]
    assert not twin.rollback(half + 1)
    assert compiled.replay(ids[:3] + ids[:3]).failed  # tokens the grammar refuses


def test_cache_hits_and_bounds(tok):
    limits = GrammarLimits(max_chars=200, cache_entries=2, cache_bytes=1 << 30)
    c = GrammarCompiler.for_tokenizer(tok, limits)
    first = c.compile(Constraint("regex", "a+"))
    assert c.compile(Constraint("regex", "a+")) is first
    assert (c.stats.hits, c.stats.misses, c.stats.entries) == (1, 1, 1)
    c.compile(Constraint("regex", "b+"))
    c.compile(Constraint("regex", "c+"))  # evicts a+, the least recently used
    assert (c.stats.entries, c.stats.evictions) == (2, 1)
    assert c.cached(Constraint("regex", "a+")) is None
    assert c.stats.bytes == sum(e.cost_bytes for e in c._cache.values())
    with pytest.raises(GrammarTooLarge):
        c.compile(Constraint("regex", "a" * 201))
    small = GrammarCompiler.for_tokenizer(tok, GrammarLimits(cache_bytes=1))
    small.compile(Constraint("regex", "a+"))  # compiled and used, too large to keep
    assert small.stats.entries == 0 and small.stats.bytes == 0


def test_no_tokenizer_backend_no_compiler():
    assert GrammarCompiler.for_tokenizer(object()) is None


def test_grammars_load_no_torch(default_model_dir):
    code = (
        "import sys\n"
        "from controller.text.tokenizer import Tokenizer\n"
        "from controller.text.grammar import GrammarCompiler, Constraint\n"
        f"t = Tokenizer.from_model_dir({default_model_dir!r})\n"
        "m = GrammarCompiler.for_tokenizer(t).compile(Constraint('json_object', '')).matcher()\n"
        "m.allowed_mask()\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
