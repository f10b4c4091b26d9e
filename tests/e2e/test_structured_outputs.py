"""Structured output end to end: real controller and CPU executor processes, the official openai
client. Outputs match their constraint (JSON schemas validated with jsonschema, json_object
parsed, regexes fully matched, choices in their set, a Lark grammar), streamed and whole alike,
with sampling and logprobs; openai's parse() with a pydantic model; no KV block left behind."""

from __future__ import annotations

import asyncio
import json
import math
import re

import jsonschema
import pydantic
import pytest

from tests.e2e.helpers import (
    LONG_PROMPT,
    PROMPTS,
    assert_no_blocks_in_use,
    metric_sum,
    metrics_text,
)

ASK = [{"role": "user", "content": "Describe a person, a book and a city as JSON."}]
NAME = {"type": "string", "maxLength": 16}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": NAME,
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": NAME,
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                        "additionalProperties": False,
                    },
                },
                "required": ["name", "address"],
                "additionalProperties": False,
            }
        },
        "required": ["person"],
        "additionalProperties": False,
    },
    "enum_and_bounds": {
        "type": "object",
        "properties": {
            "color": {"enum": ["red", "green", "blue"]},
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "ok": {"type": "boolean"},
        },
        "required": ["color", "age", "score", "ok"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": NAME, "minItems": 2, "maxItems": 4},
            "points": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "minItems": 3,
                "maxItems": 3,
            },
        },
        "required": ["tags", "points"],
        "additionalProperties": False,
    },
}


def _json_format(name: str, schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def _chat_all(server, kwargs_list: list[dict]) -> list:
    """Chat completions sent at once (they share steps), in order."""

    async def run():
        async with server.async_client() as client:
            return await asyncio.gather(
                *(
                    client.chat.completions.create(model=server.model_name, **kw)
                    for kw in kwargs_list
                )
            )

    return asyncio.run(run())


def test_json_schema_outputs_validate_streamed_and_whole(server):
    calls = [
        dict(messages=ASK, max_tokens=200, temperature=0, response_format=_json_format(n, s))
        for n, s in SCHEMAS.items()
    ]
    whole = _chat_all(server, calls)
    for (name, schema), r in zip(SCHEMAS.items(), whole):
        choice = r.choices[0]
        assert choice.finish_reason == "stop", (name, choice)
        jsonschema.validate(json.loads(choice.message.content), schema)
    client = server.client()
    for call, r in zip(calls, whole):  # streamed: the same text, chunk by chunk
        chunks = client.chat.completions.create(model=server.model_name, stream=True, **call)
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        assert len(pieces) > 2 and "".join(pieces) == r.choices[0].message.content
    assert_no_blocks_in_use(server)


def test_sampled_outputs_validate_and_a_seed_repeats(server):
    schema = SCHEMAS["enum_and_bounds"]
    fmt = _json_format("sampled", schema)
    calls = [
        dict(messages=ASK, max_tokens=200, temperature=1.0, top_p=0.9, seed=s, response_format=fmt)
        for s in (1, 2, 3, 1)
    ]
    rs = _chat_all(server, calls)
    for r in rs:
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    assert rs[0].choices[0].message.content == rs[3].choices[0].message.content
    r = server.client().chat.completions.create(
        model=server.model_name,
        messages=ASK,
        max_tokens=200,
        n=3,
        temperature=1.0,
        response_format=fmt,
    )
    for choice in r.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_json_object_parses(server):
    r = server.client().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Describe a cat as a JSON object with two keys."}],
        max_tokens=300,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize(
    "pattern",
    [
        r"[0-9]{3}-[0-9]{4}",
        r"(yes|no), because [a-z ]{5,20}\.",
        r"[A-Z][a-z]{1,10} [A-Z][a-z]{1,10}",
    ],
)
def test_regex_outputs_fully_match(server, pattern):
    r = server.client().completions.create(
        model=server.model_name,
        prompt="Answer: ",
        max_tokens=60,
        temperature=0,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert r.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, r.choices[0].text), r.choices[0].text


def test_choice_and_grammar(server):
    choices = ["Paris", "London", "Rome is not it"]
    r = server.client().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    assert r.choices[0].message.content in choices and r.choices[0].finish_reason == "stop"
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[1-9][0-9]{0,2}/'
    r = server.client().completions.create(
        model=server.model_name,
        prompt="What is 12 times 3?",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"grammar": lark}},
    )
    assert re.fullmatch(r"The answer is [1-9][0-9]{0,2}\.", r.choices[0].text)


def test_logprobs_are_of_the_constrained_distribution(server):
    """Every top logprob is of an allowed token (a prefix of a choice), and the top ones of
    the first position hold (nearly) all of the constrained probability mass."""
    choices = ["yes", "no"]
    r = server.client().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": "Is the sky blue?"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": choices}},
    )
    content = r.choices[0].logprobs.content
    first = content[0]
    assert all(any(c.startswith(t.token) for c in choices) for t in first.top_logprobs), first
    mass = sum(math.exp(t.logprob) for t in first.top_logprobs)
    assert 0.99 <= mass <= 1.0001, mass


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=16)
    age: int = pydantic.Field(ge=0, le=120)


def test_openai_parse_with_a_pydantic_model(server):
    r = server.client().chat.completions.parse(
        model=server.model_name,
        messages=[{"role": "user", "content": "Give me a person."}],
        max_tokens=100,
        temperature=0,
        response_format=Person,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, Person), r


def test_preempted_constrained_requests_resume_under_their_grammar(tight_server):
    """Six constrained completions at once on a server with 20 KV blocks: some are preempted
    and recomputed mid-output; each resumes at its grammar position, so every output is the
    valid one it is when run alone."""
    server = tight_server
    schema = {
        "type": "object",
        "properties": {"words": {"type": "array", "items": NAME, "minItems": 8, "maxItems": 8}},
        "required": ["words"],
        "additionalProperties": False,
    }
    prompts = [f"{PROMPTS[i % 4]} {LONG_PROMPT[: 80 + 30 * i]}" for i in range(6)]
    extra = {"structured_outputs": {"json": schema}}

    def call(prompt: str) -> dict:
        return dict(
            model=server.model_name,
            prompt=prompt,
            max_tokens=200,
            temperature=0,
            extra_body=extra,
        )

    alone = [server.client().completions.create(**call(p)).choices[0].text for p in prompts]
    before = metric_sum(metrics_text(server), "vllm:num_preemptions_total")

    async def at_once():
        async with server.async_client() as client:
            return await asyncio.gather(*(client.completions.create(**call(p)) for p in prompts))

    together = [r.choices[0].text for r in asyncio.run(at_once())]
    assert metric_sum(metrics_text(server), "vllm:num_preemptions_total") > before
    assert together == alone
    for text in together:
        jsonschema.validate(json.loads(text), schema)
    assert_no_blocks_in_use(server)
