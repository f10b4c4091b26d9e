"""Hostile request bodies, one class per test, against the default server: each gets its status
code at once, costs the controller little time and memory, loses no executor, and leaves a
concurrent greedy request's answer unchanged.

Before (main at 3aa6b4e, the issue's table): the seed overflowed int64 and made the executor
count as lost ~100 times in 30 s; a 40,000-character stop string cost +750 MiB per choice
(+12 GiB with n=16); 300,000 one-token prompts took 35 s and +1 GiB to get their 400; model
"\\ud800" was a 500 that closed the connection; temperature 1e-39 answered an empty text.
"""

from __future__ import annotations

import json

import pytest

from tests.e2e.adversarial.bounds_support import (
    REFERENCE,
    innocent,
    measure,
    post,
    raw_exchanges,
)

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
FAST = 15.0  # seconds: a refusal is immediate; generous for a loaded two-core machine
SMALL_MIB = 60  # controller memory a refused or small request may leave behind
INT64_MAX = 2**63 - 1
MESSAGE = {"role": "user", "content": "hi"}


@pytest.fixture(scope="module")
def reference(server) -> str:
    return innocent(server)


def _check(cost, reference: str, seconds: float = FAST, mib: float = SMALL_MIB) -> None:
    assert cost.seconds < seconds, cost
    assert cost.rss_growth_mib < mib, cost
    assert cost.executor_losses == 0, cost
    assert cost.innocent_text == reference, cost


def _error(response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text[:500]
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def test_seed_past_int64_with_n(server, reference):
    """Every choice's seed stays in int64 (seed + choice wraps), so nothing overflows on the
    way to the executor."""
    for seed in (INT64_MAX, -(2**63)):
        body = {"prompt": "hi", "n": 16, "seed": seed, "max_tokens": 2}
        r, cost = measure(server, post(server, COMPLETIONS, body))
        assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text[:300]
        _check(cost, reference, seconds=120)
    # Seeded sampling stays reproducible at the edge of the range.
    seeded = post(server, COMPLETIONS, {"prompt": "hi", "n": 2, "seed": INT64_MAX, "max_tokens": 4})
    texts = [[c["text"] for c in seeded().json()["choices"]] for _ in range(2)]
    assert texts[0] == texts[1], texts


def test_stop_strings_long_and_many(server, reference):
    """A 40,000-character stop string and 17 stop strings are refused; 16 stop strings of
    1,024 characters for 16 choices run in linear memory."""
    r, cost = measure(
        server, post(server, COMPLETIONS, {"prompt": "hi", "stop": "x" * 40_000, "n": 16})
    )
    _error(r, 400, "stop")
    _check(cost, reference)
    r, cost = measure(server, post(server, COMPLETIONS, {"prompt": "hi", "stop": ["a"] * 17}))
    _error(r, 400, "stop")
    _check(cost, reference)
    stops = [f"{i:02d}" + "never " * 170 for i in range(16)]
    body = {"prompt": "hi", "stop": stops, "n": 16, "max_tokens": 8}
    r, cost = measure(server, post(server, COMPLETIONS, body))
    assert r.status_code == 200 and len(r.json()["choices"]) == 16, r.text[:300]
    _check(cost, reference, seconds=120)


def test_many_prompts_are_refused_before_parsing_them(server, reference):
    body = json.dumps({"prompt": [[1]] * 300_000, "n": 16, "max_tokens": 2}).encode()
    r, cost = measure(server, post(server, COMPLETIONS, body))
    _error(r, 400, "prompt")
    _check(cost, reference, mib=150)  # the 1.5 MB body parsed once
    r, cost = measure(server, post(server, COMPLETIONS, {"prompt": ["a"] * 1025, "n": 1}))
    assert _error(r, 400, "prompt")["code"] == "too_many_sequences"
    _check(cost, reference)


def test_long_text_is_refused_before_tokenizing(server, reference):
    """3.9 MB of text cannot fit the context: refused on its length (tokenizing it took 2.3 s
    of the event loop)."""
    text = "word " * 780_000
    r, cost = measure(server, post(server, COMPLETIONS, {"prompt": text, "max_tokens": 2}))
    assert _error(r, 400, "prompt")["code"] == "context_length_exceeded"
    assert "characters" in r.json()["error"]["message"]
    _check(cost, reference)
    chat = {"messages": [{"role": "user", "content": text}], "max_tokens": 2}
    r, cost = measure(server, post(server, CHAT, chat))
    _error(r, 400, "messages")
    _check(cost, reference)


def test_unencodable_input_keeps_the_connection(server, reference):
    """Lone surrogates in a model name, a logit_bias key, a prompt: 4xx, and the keep-alive
    connection serves the next request."""
    hostile = [
        b'{"model": "\\ud800", "prompt": "hi", "max_tokens": 2}',
        b'{"prompt": "hi", "logit_bias": {"\\udfff": 1}, "max_tokens": 2}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"model": "' + b"m" * 1_000_000 + b'", "prompt": "hi"}',
    ]
    ok = json.dumps({**REFERENCE, "max_tokens": 2}).encode()
    codes = raw_exchanges(server, [x for h in hostile for x in (h, ok)], COMPLETIONS)
    assert codes == [404, 200, 400, 200, 400, 200, 404, 200], codes
    r, cost = measure(server, post(server, COMPLETIONS, hostile[0]))
    body = _error(r, 404, "model")
    assert body["code"] == "model_not_found" and len(body["message"]) < 200
    _check(cost, reference)


def test_tiny_temperature_is_greedy(server, reference):
    body = {**REFERENCE, "temperature": 1e-39}
    r, cost = measure(server, post(server, COMPLETIONS, body))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference
    _check(cost, reference, seconds=120)


@pytest.mark.parametrize(
    "body,param",
    [
        ({"max_tokens": 2**31}, "max_tokens"),
        ({"min_tokens": 2**40, "max_tokens": 2}, "min_tokens"),
        ({"priority": -(2**70)}, "priority"),
        ({"seed": 2**64}, "seed"),
        ({"logprobs": 10**9}, "logprobs"),
        ({"stop_token_ids": [2**31]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(257))}, "stop_token_ids"),
        ({"prompt": [2**40]}, "prompt"),
        ({"prompt": [[1, -1]]}, "prompt"),
        ({"n": 2**63}, "n"),
    ],
)
def test_integers_out_of_range(server, reference, body, param):
    r, cost = measure(server, post(server, COMPLETIONS, {"prompt": "hi", **body}))
    _error(r, 400, param)
    _check(cost, reference)


def test_chat_messages_and_tools(server, reference):
    tool = {"type": "function", "function": {"name": "f", "parameters": {}}}
    for body, param in (
        ({"messages": [MESSAGE] * 4097}, "messages"),
        ({"messages": [MESSAGE], "tools": [tool] * 129}, "tools"),
        ({"messages": [MESSAGE], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ):
        r, cost = measure(server, post(server, CHAT, {**body, "max_tokens": 2}))
        _error(r, 400, param)
        _check(cost, reference)
    r, cost = measure(server, post(server, CHAT, {"messages": [MESSAGE] * 50, "max_tokens": 2}))
    assert r.status_code == 200, r.text[:300]
    _check(cost, reference, seconds=120)
