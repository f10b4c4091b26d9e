"""Generators of hostile request bodies for the fuzz tests: huge n, huge prompt lists, long
and many stop strings, extreme integers, odd Unicode (lone surrogates, controls, the last code
point), deep and large JSON. Seeded, so a failing batch can be replayed."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

COMPLETIONS, CHAT, TOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize"
EXTREME_INTS = [
    0,
    -1,
    1,
    16,
    17,
    2**31 - 1,
    2**31,
    2**63 - 1,
    2**63,
    -(2**63),
    -(2**63) - 1,
    2**64,
    10**30,
]
EXTREME_FLOATS = [0.0, 1e-39, 5e-324, -0.0, 1e-5, 2.0, 2.0000001, -1.0, 1e308, 3.4e38]
ODD_TEXTS = ["\ud800", "\udfff\ud800", "\x00", "\u202e", "\U0010ffff", "\ufffe", "é" * 3, ""]
INT_FIELDS = ["n", "seed", "max_tokens", "min_tokens", "top_k", "priority", "logprobs"]
FLOAT_FIELDS = ["temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty"]


def _text(rng: random.Random, most: int) -> str:
    pick = rng.random()
    if pick < 0.3:
        return rng.choice(ODD_TEXTS) * rng.randint(1, 4)
    if pick < 0.6:
        return "".join(chr(rng.randint(1, 0x10FFFF)) for _ in range(rng.randint(0, 30)))
    return rng.choice("ab <|>\n") * rng.randint(1, most)


def _prompt(rng: random.Random):
    kind = rng.randrange(5)
    if kind == 0:
        return _text(rng, 50_000)
    if kind == 1:
        return [
            rng.choice([1, 2, 300, -1, 2**40, 49151, 49152]) for _ in range(rng.randint(0, 3000))
        ]
    if kind == 2:
        return [[1]] * rng.choice([1, 2, 1025, 20_000])
    if kind == 3:
        return [_text(rng, 20) for _ in range(rng.randint(1, 40))]
    return rng.choice([[], [[]], [[1], "a"], [1.5], None, {"a": 1}])


def _stop(rng: random.Random):
    return rng.choice(
        [
            "x" * rng.choice([1, 1024, 1025, 40_000]),
            [_text(rng, 2000) or "s" for _ in range(rng.randint(1, 20))],
            ["\ud800"],
        ]
    )


def _deep(depth: int) -> str:
    return "[" * depth + "]" * depth


def _completion(rng: random.Random) -> dict:
    body: dict = {"prompt": _prompt(rng), "max_tokens": rng.choice([1, 2, 4, *EXTREME_INTS])}
    for name in rng.sample(INT_FIELDS, rng.randint(0, 4)):
        body[name] = rng.choice(EXTREME_INTS)
    for name in rng.sample(FLOAT_FIELDS, rng.randint(0, 2)):
        body[name] = rng.choice(EXTREME_FLOATS)
    if rng.random() < 0.4:
        body["stop"] = _stop(rng)
    if rng.random() < 0.2:
        body["stop_token_ids"] = [rng.choice(EXTREME_INTS) for _ in range(rng.choice([1, 300]))]
    if rng.random() < 0.2:
        body["model"] = _text(rng, 1000)
    if rng.random() < 0.2:
        body["stream"] = True
    if isinstance(body.get("max_tokens"), int) and 0 < body["max_tokens"] <= 2**31 - 1:
        body["max_tokens"] = min(body["max_tokens"], 4)  # fuzz sizes, not generation lengths
    return body


def _chat(rng: random.Random) -> dict:
    message = {"role": rng.choice(["user", "system", "tool", "wizard"]), "content": _text(rng, 500)}
    body: dict = {"messages": [message] * rng.choice([1, 3, 4097]), "max_tokens": 2}
    if rng.random() < 0.3:
        body["tools"] = [{"type": "function", "function": {"name": "f"}}] * rng.choice([1, 129])
    if rng.random() < 0.3:
        body["logprobs"], body["top_logprobs"] = True, rng.choice(EXTREME_INTS)
    if rng.random() < 0.3:
        body["n"] = rng.choice(EXTREME_INTS)
    return body


def hostile_bodies(seed: int, count: int) -> Iterator[tuple[str, bytes]]:
    """`count` (path, raw JSON body) pairs."""
    rng = random.Random(seed)
    for _ in range(count):
        roll = rng.random()
        if roll < 0.55:
            path, body = COMPLETIONS, json.dumps(_completion(rng)).encode()
        elif roll < 0.8:
            path, body = CHAT, json.dumps(_chat(rng)).encode()
        elif roll < 0.9:
            path, body = TOKENIZE, json.dumps({"prompt": _text(rng, 100_000)}).encode()
        else:  # deep or huge JSON around a valid request
            depth = rng.choice([100, 1000, 100_000])
            path = COMPLETIONS
            body = b'{"prompt": "hi", "max_tokens": 2, "extra": ' + _deep(depth).encode() + b"}"
        yield path, body
