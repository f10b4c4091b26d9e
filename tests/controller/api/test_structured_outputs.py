"""Structured-output and tool parameters through the real app in-process (the default model's
tokenizer, a fake engine): valid constraints are compiled onto the generation requests,
refused, oversized and misshapen ones are 400s naming the parameter, and a repeated schema is
answered from the grammar cache."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from pydantic import BaseModel

from controller.api.server import create_app
from controller.api.serving import OpenAIServing
from controller.core.outputs import OutputDelta
from controller.text.tokenizer import Tokenizer
from tests.support.fake_engine import FakeEngineBase

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "tier": {"enum": ["free", "pro"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
    },
    "required": ["name", "tier"],
    "additionalProperties": False,
}
ANSWER = '{"name": "Ada", "tier": "pro"}'
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}


class FakeEngine(FakeEngineBase):
    """Answers ANSWER for every sequence and keeps the generation requests it was given."""

    def __init__(self, tokenizer: Tokenizer, **config):
        super().__init__(tokenizer.eos_token_ids, **config)
        self._ids = tokenizer.encode(ANSWER, add_special_tokens=False)

    async def generate(self, gen):
        self.gens.append(gen)
        yield OutputDelta(
            gen.request_id,
            text=ANSWER,
            token_ids=list(self._ids),
            finished=True,
            finish_reason="stop",
            num_prompt_tokens=len(gen.prompt_token_ids),
            num_output_tokens=len(self._ids),
        )


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir)


def _app(tokenizer, **config):
    engine = FakeEngine(tokenizer, **config)
    serving = OpenAIServing(engine, tokenizer, "m", 5)
    return engine, serving, create_app(engine, serving, start_engine=False)


def _client(app) -> httpx.AsyncClient:
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    return httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60)


def _post_all(app, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    async def main():
        async with _client(app) as http:
            return [await http.post(path, json=body) for path, body in bodies]

    return asyncio.run(main())


CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def chat(**extra) -> tuple[str, dict]:
    return CHAT, {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def completion(**extra) -> tuple[str, dict]:
    return COMPLETIONS, {"model": "m", "prompt": "hi", "max_tokens": 8, **extra}


def json_schema_format(schema=SCHEMA, **extra) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, **extra}}


VALID = [
    (chat(response_format=json_schema_format(strict=True)), "json_schema"),
    (completion(response_format=json_schema_format()), "json_schema"),
    (chat(response_format={"type": "json_object"}), "json_object"),
    (completion(response_format={"type": "json_object"}), "json_object"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), "json_object"),
    (chat(response_format={"type": "text"}), None),
    (chat(structured_outputs={"json": SCHEMA}), "json_schema"),
    (completion(structured_outputs={"json": json.dumps(SCHEMA)}), "json_schema"),
    (completion(structured_outputs={"regex": "[0-9]{3}-[a-z]+"}), "regex"),
    (chat(structured_outputs={"choice": ["yes", "no"]}), "choice"),
    (completion(structured_outputs={"grammar": 'root ::= "a" | "b"'}), "grammar"),
    (chat(structured_outputs={"json_object": True}), "json_object"),
]


@pytest.mark.parametrize("request_,kind", VALID, ids=[str(i) for i in range(len(VALID))])
def test_valid_constraints_are_compiled_onto_the_request(tokenizer, request_, kind):
    engine, _, app = _app(tokenizer)
    (r,) = _post_all(app, [request_])
    assert r.status_code == 200, r.text
    (gen,) = engine.gens
    if kind is None:
        assert gen.grammar is None
    else:
        assert gen.grammar.constraint.kind == kind
        assert gen.grammar.matcher().allowed_tokens()  # a usable grammar


def test_tools_and_tool_choice(tokenizer):
    """tool_choice "required" and a named function constrain the output to the tool-call
    format's calls (one grammar); "auto", "none" and no tool_choice leave it free (a strict
    tool under "auto" is not enforced)."""
    engine, _, app = _app(tokenizer)
    other = {"type": "function", "function": {"name": "noop", "strict": True}}
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [
        chat(tools=[TOOL, other], tool_choice="auto", parallel_tool_calls=False),
        chat(tools=[TOOL, other], tool_choice="required"),
        chat(tools=[TOOL, other], tool_choice=named),
        chat(tools=[TOOL, other], tool_choice="none"),
        chat(tools=[TOOL]),
    ]
    responses = _post_all(app, bodies)
    assert [r.status_code for r in responses] == [200] * 5, [r.text for r in responses]
    kinds = [None if g.grammar is None else g.grammar.constraint.kind for g in engine.gens]
    assert kinds == [None, "grammar", "grammar", None, None]
    required, named_one = engine.gens[1].grammar, engine.gens[2].grammar
    call = '<tool_call>[{"name": "noop", "arguments": {}}]</tool_call>'
    assert required.matcher().accept_all(tokenizer.encode(call, add_special_tokens=False))
    assert not named_one.matcher().accept_all(tokenizer.encode(call, add_special_tokens=False))


def test_response_format_and_forced_tools_are_400(tokenizer):
    engine, _, app = _app(tokenizer)
    named = {"type": "function", "function": {"name": "get_weather"}}
    responses = _post_all(
        app,
        [
            chat(tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}),
            chat(tools=[TOOL], tool_choice=named, structured_outputs={"regex": "a"}),
        ],
    )
    for r in responses:
        err = _error(r)
        assert err["param"] == "tool_choice" and "response_format" in err["message"], err
    assert engine.gens == []
    ok = _post_all(
        app, [chat(tools=[TOOL], tool_choice="auto", response_format={"type": "json_object"})]
    )
    assert ok[0].status_code == 200  # "auto" leaves the output to response_format


def _error(r: httpx.Response) -> dict:
    assert r.status_code == 400, r.text
    return r.json()["error"]


REFUSED = [
    (chat(response_format=json_schema_format({"type": "foo"})), "response_format", "foo"),
    (
        completion(
            response_format=json_schema_format({"type": "string", "minLength": 3, "maxLength": 1})
        ),
        "response_format.json_schema.schema",
        "nsatisfiable",
    ),
    (
        chat(structured_outputs={"json": {"$ref": "#/missing"}}),
        "structured_outputs.json",
        "missing",
    ),
    (completion(structured_outputs={"regex": "(["}), "structured_outputs.regex", "unclosed"),
    (completion(structured_outputs={"regex": "a{5,2}"}), "structured_outputs.regex", "repetition"),
    (
        chat(structured_outputs={"grammar": "start: nothing_here"}),
        "structured_outputs.grammar",
        "nothing_here",
    ),
    (
        chat(structured_outputs={"grammar": "root ::= nothing"}),
        "structured_outputs.grammar",
        "nothing",
    ),
    (
        chat(
            tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}],
            tool_choice="required",
        ),
        "tools[0].function.parameters",
        "type",
    ),
]


@pytest.mark.parametrize(
    "request_,param,reason", REFUSED, ids=[str(i) for i in range(len(REFUSED))]
)
def test_refused_constraints_are_400_with_the_reason(tokenizer, request_, param, reason):
    engine, _, app = _app(tokenizer)
    (r,) = _post_all(app, [request_])
    err = _error(r)
    assert err["param"].startswith(param) and reason in err["message"], err
    assert err["code"] == "invalid_grammar" and err["type"] == "invalid_request_error"
    assert engine.gens == []  # nothing was queued


def test_refusals_quote_little_of_the_clients_text(tokenizer):
    _, _, app = _app(tokenizer)
    regex = "(" + "a" * 5000
    (r,) = _post_all(app, [completion(structured_outputs={"regex": regex})])
    message = _error(r)["message"]
    assert "a" * 101 not in message and len(message) < 1000


MISSHAPEN = [
    chat(response_format={"type": "json_schema"}),
    chat(response_format={"type": "xml"}),
    chat(
        response_format={"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}
    ),
    chat(structured_outputs={"regex": "a", "choice": ["a"]}),
    chat(structured_outputs={}),
    chat(structured_outputs={"choice": []}),
    chat(structured_outputs={"json": "{not json"}),
    chat(structured_outputs={"regex": "a", "unknown": 1}),
    chat(response_format={"type": "json_object"}, structured_outputs={"regex": "a"}),
    chat(tools=[{"type": "retrieval"}]),
    chat(tools=[{"type": "function", "function": {"name": "has space"}}]),
    chat(tools=[TOOL], tool_choice="sometimes"),
    chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "absent"}}),
    chat(tool_choice="required"),
]


@pytest.mark.parametrize("request_", MISSHAPEN, ids=[str(i) for i in range(len(MISSHAPEN))])
def test_misshapen_parameters_are_400(tokenizer, request_):
    engine, _, app = _app(tokenizer)
    (r,) = _post_all(app, [request_])
    assert _error(r)["message"]
    assert engine.gens == []


def test_oversized_constraints_are_400_before_compiling(tokenizer):
    engine, serving, app = _app(tokenizer, max_grammar_chars=200)
    big = {"type": "object", "properties": {f"field_{i}": {"type": "string"} for i in range(20)}}
    responses = _post_all(
        app,
        [
            chat(response_format=json_schema_format(big)),
            completion(structured_outputs={"regex": "a" * 201}),
            chat(structured_outputs={"choice": ["x" * 100, "y" * 100]}),
            chat(
                tools=[{"type": "function", "function": {"name": "f", "parameters": big}}],
                tool_choice="required",
            ),
            completion(structured_outputs={"regex": "a" * 200}),  # at the limit: fine
        ],
    )
    for r in responses[:4]:
        err = _error(r)
        assert err["code"] == "grammar_too_large" and "200" in err["message"]
    assert responses[4].status_code == 200
    assert serving.constraints.compiler.stats.misses == 1  # only the last one compiled


def test_a_repeated_schema_hits_the_cache(tokenizer):
    engine, serving, app = _app(tokenizer)
    stats = serving.constraints.compiler.stats
    responses = _post_all(app, [chat(response_format=json_schema_format())] * 3)
    assert [r.status_code for r in responses] == [200] * 3
    assert (stats.misses, stats.hits, stats.entries) == (1, 2, 1)
    assert engine.gens[0].grammar is engine.gens[2].grammar


def test_the_openai_client_parse_helper_is_accepted(tokenizer):
    """openai's parse() with a pydantic model sends a strict json_schema response_format."""
    import openai

    class Person(BaseModel):
        name: str
        tier: str

    engine, _, app = _app(tokenizer)

    async def main():
        async with _client(app) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http)
            done = await client.chat.completions.parse(
                model="m", messages=[{"role": "user", "content": "hi"}], response_format=Person
            )
            return done.choices[0].message.parsed

    assert asyncio.run(main()) == Person(name="Ada", tier="pro")
    assert engine.gens[0].grammar.constraint.kind == "json_schema"
